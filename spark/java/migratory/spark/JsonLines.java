package migratory.spark;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonGenerator;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonToken;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.time.ZoneOffset;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import org.apache.spark.api.java.function.FlatMapFunction;
import org.apache.spark.rdd.RDD;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.GenericInternalRow;
import org.apache.spark.sql.catalyst.json.JSONOptions;
import org.apache.spark.sql.catalyst.util.ArrayBasedMapData;
import org.apache.spark.sql.catalyst.util.ArrayData;
import org.apache.spark.sql.catalyst.util.MapData;
import org.apache.spark.sql.catalyst.util.DateTimeUtils;
import org.apache.spark.sql.catalyst.util.GenericArrayData;
import org.apache.spark.sql.classic.Dataset;
import org.apache.spark.sql.types.BooleanType;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.DoubleType;
import org.apache.spark.sql.types.IntegerType;
import org.apache.spark.sql.types.LongType;
import org.apache.spark.sql.types.MapType;
import org.apache.spark.sql.types.StringType;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.unsafe.Platform;
import org.apache.spark.unsafe.types.UTF8String;
import scala.Option;

/**
 * Log lines to typed rows: each line must be exactly one JSON object of the schema.
 *
 * <p>The same rules as the Python reader's {@code from_json} path (migratory_spark/reader.py), in one
 * pass over the line's bytes: Spark's {@code from_json} wraps every line in an InputStreamReader (an
 * 8 KB buffer allocated and zeroed per line) and a char-based parser, which was a third of the parse.
 * Values convert as Spark's JacksonParser converts them (same Jackson features, same type rules); a
 * line whose bytes are not strict UTF-8 is decoded with replacement characters first, as Spark's
 * reader decodes it, so both paths give the same rows.
 */
public final class JsonLines {
  private JsonLines() {}

  /** The Spark version this class was compiled against (its jar's manifest), or null outside a jar. */
  public static String sparkVersion() {
    return JsonLines.class.getPackage().getImplementationVersion();
  }

  /**
   * {@code lines} (a string column {@code value}, and any others) to the other columns, the {@code
   * keep} fields of the schema (every field is checked, only those are kept), {@code time} (the
   * {@code ts} field as a timestamp, null on a corrupt line), {@code blank} (nothing but JSON
   * whitespace), {@code bad} (corrupt: see the reader) and {@code example} (the first {@code
   * exampleBytes} bytes of a corrupt line, else null).
   */
  public static org.apache.spark.sql.Dataset<Row> parse(
      Dataset<Row> lines, StructType schema, List<String> keep, int version, int exampleBytes) {
    StructField[] in = lines.schema().fields();
    int value = lines.schema().fieldIndex("value");
    // the other columns, passed through in their order
    int[] columns = new int[in.length - 1];
    DataType[] types = new DataType[in.length - 1];
    StructType out = new StructType();
    for (int i = 0, at = 0; i < in.length; i++) {
      if (i != value) {
        out = out.add(in[i]);
        columns[at] = i;
        types[at++] = in[i].dataType();
      }
    }
    int[] fields = new int[keep.size()];
    for (int i = 0; i < fields.length; i++) {
      fields[i] = schema.fieldIndex(keep.get(i));
      out = out.add(keep.get(i), schema.fields()[fields[i]].dataType());
    }
    out = out.add("time", DataTypes.TimestampType)
        .add("blank", DataTypes.BooleanType, false)
        .add("bad", DataTypes.BooleanType, false)
        .add("example", DataTypes.BinaryType);
    RDD<InternalRow> input = lines.queryExecution().toRdd();
    Parse parse = new Parse(schema, fields, version, exampleBytes, value, columns, types);
    RDD<InternalRow> rows = input.toJavaRDD().mapPartitions(parse).rdd();
    return lines.sparkSession().internalCreateDataFrame(rows, out, false);
  }

  /** One task's lines; the converters are built once per task. */
  static final class Parse implements FlatMapFunction<Iterator<InternalRow>, InternalRow> {
    private static final long serialVersionUID = 1L;
    private final StructType schema;
    private final int[] fields;
    private final int version;
    private final int exampleBytes;
    private final int value;
    private final int[] columns;
    private final DataType[] types;

    Parse(
        StructType schema, int[] fields, int version, int exampleBytes, int value, int[] columns, DataType[] types) {
      this.schema = schema;
      this.fields = fields;
      this.version = version;
      this.exampleBytes = exampleBytes;
      this.value = value;
      this.columns = columns;
      this.types = types;
    }

    @Override
    public Iterator<InternalRow> call(Iterator<InternalRow> input) {
      LineParser parser = new LineParser(schema, fields, version, exampleBytes, columns.length);
      return new Iterator<InternalRow>() {
        @Override
        public boolean hasNext() {
          return input.hasNext();
        }

        @Override
        public InternalRow next() {
          InternalRow row = input.next();
          Object[] out = parser.row();
          for (int i = 0; i < columns.length; i++) {
            out[i] = row.isNullAt(columns[i]) ? null : copy(row.get(columns[i], types[i]));
          }
          parser.parse(row.isNullAt(value) ? null : row.getUTF8String(value), out);
          return new GenericInternalRow(out);
        }
      };
    }
  }

  /** A value of the input row that may point into its reused buffer (string, struct, array, map) is copied. */
  private static Object copy(Object value) {
    if (value instanceof UTF8String text) {
      return text.clone();
    }
    if (value instanceof InternalRow struct) {
      return struct.copy();
    }
    if (value instanceof ArrayData array) {
      return array.copy();
    }
    if (value instanceof MapData map) {
      return map.copy();
    }
    return value;
  }

  /** Converts one JSON value (the parser on its first token) to Spark's internal value. */
  interface Converter {
    Object convert(JsonParser parser) throws IOException;
  }

  /** A line failed a rule: it is corrupt (never thrown past {@link LineParser#parse}). */
  static final class Corrupt extends RuntimeException {
    private static final long serialVersionUID = 1L;

    Corrupt() {
      super(null, null, false, false);
    }
  }

  private static final Corrupt CORRUPT = new Corrupt();

  /** The parser of one task: not thread-safe, reused for every line. */
  static final class LineParser {
    // Spark's own, from from_json's default options: the same Jackson features and limits
    private final JsonFactory factory =
        new JSONOptions(scala.collection.immutable.Map$.MODULE$.<String, String>empty(), "UTC", "_corrupt")
            .buildJsonFactory();
    private final Map<String, Integer> index = new HashMap<>();
    private final Converter[] converters;
    private final int v;
    private final int ts;
    private final int event;
    private final int version;
    private final int exampleBytes;
    private final int lead;
    private final int[] kept;
    private final Object[] values;

    LineParser(StructType schema, int[] kept, int version, int exampleBytes, int lead) {
      this.lead = lead;
      this.kept = kept;
      this.values = new Object[schema.fields().length];
      StructField[] all = schema.fields();
      converters = new Converter[all.length];
      for (int i = 0; i < all.length; i++) {
        index.put(all[i].name(), i);
        converters[i] = converter(all[i].dataType());
      }
      v = index.get("v");
      ts = index.get("ts");
      event = index.get("event");
      this.version = version;
      this.exampleBytes = exampleBytes;
    }

    /** A new output row: the lead (copied) columns, the kept fields, time, blank, bad, example. */
    Object[] row() {
      return new Object[lead + kept.length + 4];
    }

    /** One line into {@code out} after its lead columns; a null line is corrupt (as from_json has it). */
    void parse(UTF8String line, Object[] out) {
      if (line == null) {
        out[lead + kept.length + 2] = true;  // bad, with no example
        out[lead + kept.length + 1] = false;
        return;
      }
      byte[] bytes;
      int offset;
      int length = line.numBytes();
      if (line.getBaseObject() instanceof byte[] array) {
        bytes = array;
        offset = (int) (line.getBaseOffset() - Platform.BYTE_ARRAY_OFFSET);
      } else {
        bytes = line.getBytes();
        offset = 0;
      }
      int start = offset;
      int end = offset + length;
      while (start < end && isSpace(bytes[start])) {
        start++;
      }
      boolean blank = start == end;
      boolean bad = false;
      Object time = null;
      Arrays.fill(values, null);
      if (!blank) {
        try {
          // a line must open an object (this also keeps Jackson from guessing UTF-16/32 or skipping a BOM)
          if (bytes[start] != '{') {
            throw CORRUPT;
          }
          if (strictUtf8(bytes, start, end)) {
            try (JsonParser parser = factory.createParser(bytes, start, end - start)) {
              root(parser);
            }
          } else {
            // as Spark's reader decodes it: each malformed sequence becomes U+FFFD
            String text = new String(bytes, start, end - start, StandardCharsets.UTF_8);
            try (JsonParser parser = factory.createParser(text)) {
              root(parser);
            }
          }
          time = timestamp((UTF8String) values[ts]);
          Object ver = values[v];
          bad = time == null || values[event] == null || ver == null || (Integer) ver != version;
        } catch (IOException | RuntimeException e) {
          bad = true;
        }
      }
      int at = lead;
      if (!bad) {  // a corrupt line has no field to read and no time
        for (int field : kept) {
          out[at++] = values[field];
        }
        out[at++] = time;
      } else {
        at += kept.length + 1;
      }
      out[at++] = blank;
      out[at++] = bad;
      if (bad) {
        out[at] = Arrays.copyOfRange(bytes, offset, offset + Math.min(length, exampleBytes));
      }
    }

    /** The root object into {@link #values}; anything after it but whitespace makes the line corrupt. */
    private void root(JsonParser parser) throws IOException {
      if (parser.nextToken() != JsonToken.START_OBJECT) {
        throw CORRUPT;
      }
      readObject(parser, index, converters, values);
      if (parser.nextToken() != null) {
        throw CORRUPT;
      }
    }
  }

  /**
   * The fields of the object the parser has just opened into {@code values}, by name; unknown ones are
   * skipped, and a repeated one keeps its last value (as Spark does). Jackson itself rejects an object
   * that is not closed.
   */
  private static void readObject(
      JsonParser parser, Map<String, Integer> names, Converter[] converters, Object[] values)
      throws IOException {
    while (parser.nextToken() == JsonToken.FIELD_NAME) {
      Integer at = names.get(parser.currentName());
      parser.nextToken();
      if (at == null) {
        parser.skipChildren();
      } else {
        values[at] = converters[at].convert(parser);
      }
    }
  }

  private static boolean isSpace(byte b) {
    return b == ' ' || b == '\t' || b == '\r' || b == '\n';
  }

  /** {@code yyyy-MM-ddTHH:mm:ss.SSSZ} exactly, cast as Spark casts a string to a timestamp (UTC). */
  static Object timestamp(UTF8String ts) {
    if (ts == null || ts.numBytes() != 24) {
      return null;
    }
    if (ts.getByte(23) != 'Z' || ts.getByte(10) != 'T' || ts.getByte(19) != '.') {
      return null;
    }
    Option<Object> micros = DateTimeUtils.stringToTimestamp(ts, ZoneOffset.UTC);
    return micros.isDefined() ? micros.get() : null;
  }

  /** True when the bytes are strict UTF-8 (what Java's decoder accepts without replacing anything). */
  static boolean strictUtf8(byte[] b, int from, int to) {
    int i = from;
    while (i < to) {
      int c = b[i] & 0xFF;
      if (c < 0x80) {
        i++;
        continue;
      }
      int need;
      int min;
      if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
        min = 0x80;
      } else if (c >= 0xE0 && c <= 0xEF) {
        need = 2;
        min = 0x800;
      } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3;
        min = 0x10000;
      } else {
        return false;
      }
      if (i + need >= to) {
        return false;
      }
      int cp = c & (0x3F >> need);
      for (int k = 1; k <= need; k++) {
        int cc = b[i + k] & 0xFF;
        if ((cc & 0xC0) != 0x80) {
          return false;
        }
        cp = (cp << 6) | (cc & 0x3F);
      }
      if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
        return false;
      }
      i += need + 1;
    }
    return true;
  }

  private static Converter converter(DataType type) {
    if (type instanceof IntegerType) {
      return p -> p.currentToken() == JsonToken.VALUE_NUMBER_INT ? (Object) p.getIntValue() : other(p);
    }
    if (type instanceof LongType) {
      return p -> p.currentToken() == JsonToken.VALUE_NUMBER_INT ? (Object) p.getLongValue() : other(p);
    }
    if (type instanceof BooleanType) {
      return p -> switch (p.currentToken()) {
        case VALUE_TRUE -> Boolean.TRUE;
        case VALUE_FALSE -> Boolean.FALSE;
        default -> other(p);
      };
    }
    if (type instanceof DoubleType) {
      return JsonLines::toDouble;
    }
    if (type instanceof StringType) {
      return JsonLines::toText;
    }
    if (type instanceof StructType struct) {
      StructField[] all = struct.fields();
      Map<String, Integer> names = new HashMap<>();
      Converter[] inner = new Converter[all.length];
      for (int i = 0; i < all.length; i++) {
        names.put(all[i].name(), i);
        inner[i] = converter(all[i].dataType());
      }
      return p -> {
        if (p.currentToken() != JsonToken.START_OBJECT) {
          return other(p);
        }
        Object[] values = new Object[all.length];
        readObject(p, names, inner, values);
        return new GenericInternalRow(values);
      };
    }
    if (type instanceof MapType map && map.keyType() instanceof StringType) {
      Converter values = converter(map.valueType());
      return p -> {
        if (p.currentToken() != JsonToken.START_OBJECT) {
          return other(p);
        }
        List<Object> keys = new ArrayList<>();
        List<Object> items = new ArrayList<>();
        while (p.nextToken() == JsonToken.FIELD_NAME) {
          keys.add(UTF8String.fromString(p.currentName()));
          p.nextToken();
          items.add(values.convert(p));
        }
        return new ArrayBasedMapData(new GenericArrayData(keys.toArray()), new GenericArrayData(items.toArray()));
      };
    }
    throw new IllegalArgumentException("unsupported type in a log schema: " + type);
  }

  /** A null (JSON null) for any type; any other token that the type does not take makes the line corrupt. */
  private static Object other(JsonParser p) {
    if (p.currentToken() == JsonToken.VALUE_NULL) {
      return null;
    }
    throw CORRUPT;
  }

  private static Object toDouble(JsonParser p) throws IOException {
    switch (p.currentToken()) {
      case VALUE_NUMBER_INT:
      case VALUE_NUMBER_FLOAT:
        return p.getDoubleValue();
      case VALUE_STRING:
        switch (p.getText()) {
          case "NaN":
            return Double.NaN;
          case "+INF":
          case "+Infinity":
          case "Infinity":
            return Double.POSITIVE_INFINITY;
          case "-INF":
          case "-Infinity":
            return Double.NEGATIVE_INFINITY;
          default:
            throw CORRUPT;
        }
      default:
        return other(p);
    }
  }

  /** A string as itself; any other value as its JSON text (Spark's rule), e.g. {@code 12} -> "12". */
  private static Object toText(JsonParser p) throws IOException {
    JsonToken token = p.currentToken();
    if (token == JsonToken.VALUE_STRING) {
      return UTF8String.fromString(p.getText());
    }
    if (token == JsonToken.VALUE_NULL) {
      return null;
    }
    ByteArrayOutputStream text = new ByteArrayOutputStream();
    try (JsonGenerator generator = GENERATORS.createGenerator(text)) {
      generator.copyCurrentStructure(p);
    }
    return UTF8String.fromBytes(text.toByteArray());
  }

  private static final JsonFactory GENERATORS = new JsonFactory();
}
