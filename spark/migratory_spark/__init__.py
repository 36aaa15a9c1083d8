"""PySpark jobs over the server's JSON-lines logs (schema in docs/logs.md).

Every analysis is a pure ``DataFrame -> DataFrame`` function over the frames that
:func:`migratory_spark.reader.read_logs` returns, so the same code runs in an
embedded local Spark, under ``spark-submit`` on a standalone cluster, or on YARN.
No analysis uses a Python UDF: executors need no Python code, only the JVM.
"""

__all__ = ["SCHEMA_VERSION"]

SCHEMA_VERSION = 1
