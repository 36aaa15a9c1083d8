"""Build the JVM line parser (spark/java) into migratory_spark/jars/migratory-spark.jar.

    python spark/build_jar.py [--out JAR] [--spark-jars DIR]

javac compiles against the jars of the PySpark it will run in (``--spark-jars``,
by default the importable pyspark's), for Java 17; the manifest names that
Spark's version, and the reader leaves a jar built for another Spark unused. The jar is reproducible: its
entries are written in name order with a fixed timestamp, so the packages that
carry it stay byte-identical from one build to the next. Without javac it exits
2 with one line naming the Debian package; the analytics then parse with Spark's
``from_json``: at 1 GB its parse took 19 s against 12 s, the whole report 40 s
against 33-34 s (bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "java"
DEFAULT_OUT = HERE / "migratory_spark" / "jars" / "migratory-spark.jar"
# zip's earliest date: no build time in the jar
FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def fail(message: str) -> NoReturn:
    """One line on standard error, exit code 2 (what the module's docstring promises)."""
    print(f"build_jar: {message}", file=sys.stderr)
    raise SystemExit(2)


def manifest(spark_version: str) -> bytes:
    """The jar's manifest: the Spark it was compiled against, which the reader checks before using it."""
    lines = ["Manifest-Version: 1.0", "Created-By: migratory build_jar.py", "Implementation-Title: migratory-spark"]
    return ("\r\n".join([*lines, f"Implementation-Version: {spark_version}"]) + "\r\n\r\n").encode()


def spark_version(jars: Path) -> str:
    """4.3.0 from spark-core_2.13-4.3.0.jar."""
    for jar in sorted(jars.glob("spark-core_*-*.jar")):
        return jar.stem.rsplit("-", 1)[1]
    fail(f"{jars}: no spark-core jar in it")


def javac() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "javac"), os.X_OK):
        return os.path.join(home, "bin", "javac")
    return shutil.which("javac")


def spark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "jars"


def build(out: Path, jars: Path) -> None:
    """Compile every source under spark/java against ``jars`` and write the jar to ``out`` (atomically)."""
    compiler = javac()
    if compiler is None:
        fail("javac not found (the JDK): apt-get install openjdk-17-jdk-headless")
    if not jars.is_dir():
        fail(f"{jars}: not a folder of Spark jars")
    version = spark_version(jars)
    sources = sorted(str(p) for p in SOURCES.rglob("*.java"))
    with tempfile.TemporaryDirectory(prefix="migratory-jar-") as tmp:
        classes = Path(tmp) / "classes"
        options = ["--release", "17", "-nowarn", "-encoding", "UTF-8", "-cp", f"{jars}/*", "-d", str(classes)]
        done = subprocess.run([compiler, *options, *sources], capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"javac failed:\n{done.stderr.strip()}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".part")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as jar:
            info = zipfile.ZipInfo("META-INF/MANIFEST.MF", FIXED_TIME)
            jar.writestr(info, manifest(version), zipfile.ZIP_DEFLATED)
            for path in sorted(classes.rglob("*.class")):
                entry = zipfile.ZipInfo(path.relative_to(classes).as_posix(), FIXED_TIME)
                entry.external_attr = 0o644 << 16
                jar.writestr(entry, path.read_bytes(), zipfile.ZIP_DEFLATED)
        os.replace(partial, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build_jar.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the jar to write")
    parser.add_argument("--spark-jars", type=Path, help="Spark's jars folder (default: the importable pyspark's)")
    args = parser.parse_args(argv)
    build(args.out, args.spark_jars or spark_jars())
    return 0


if __name__ == "__main__":
    sys.exit(main())
