"""Write migratory(1) from the CLI's own command tree, so the man page cannot drift from `--help`.

Run with the packaged interpreter (the one whose `migratory` the page documents):
    python manpage.py VERSION DATE > migratory.1
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from migratory_cli.main import app


def _roff(text: str) -> str:
    """Escape text for roff: backslashes, and a leading dot or quote that would start a request."""
    out = []
    for line in text.replace("\\", "\\e").splitlines():
        stripped = line.strip()
        out.append("\\&" + stripped if stripped.startswith((".", "'")) else stripped)
    return "\n".join(out)


def _commands(group: Any, prefix: list[str]) -> list[tuple[list[str], Any]]:
    """Every leaf command under group, depth first in name order, with its full word path.

    Typed Any: Typer vendors click under a private module, so the objects are walked by their
    click interface (commands, params, help) rather than by importing click's classes.
    """
    found: list[tuple[list[str], Any]] = []
    if hasattr(group, "commands"):
        for name in sorted(group.commands):
            found += _commands(group.commands[name], [*prefix, name])
    else:
        found.append((prefix, group))
    return found


def render(version: str, date: str) -> str:
    """The whole page: NAME, SYNOPSIS, one subsection per command with its options, FILES."""
    root: Any = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="migratory")
    lines = [
        f'.TH MIGRATORY 1 "{date}" "migratorydata {version}" "User Commands"',
        ".SH NAME",
        "migratory \\- run, configure and talk to the MigratoryData-class publish/subscribe server",
        ".SH SYNOPSIS",
        ".B migratory",
        ".I COMMAND",
        "[\\fIOPTIONS\\fR] [\\fIARGUMENTS\\fR]",
        ".SH DESCRIPTION",
        _roff(root.help or ""),
        "Every command also answers \\fB\\-\\-help\\fR.",
        ".SH COMMANDS",
    ]
    for words, command in _commands(root, []):
        sub = command.context_class(command, info_name=" ".join(words), parent=ctx)
        usage = " ".join(command.collect_usage_pieces(sub))
        lines += [".SS " + _roff(f"migratory {' '.join(words)} {usage}".strip()), _roff(command.help or "")]
        for param in command.params:
            record = param.get_help_record(sub)
            if record is None:
                if param.param_type_name == "argument":
                    lines += [".TP", f"\\fI{_roff(param.human_readable_name)}\\fR", "(argument)"]
                continue
            names, help_text = record
            lines += [".TP", f"\\fB{_roff(names)}\\fR", _roff(help_text)]
    lines += [
        ".SH FILES",
        ".TP",
        "/etc/migratorydata/migratorydata.conf",
        "The server configuration (see \\fBmigratory config check\\fR).",
        ".TP",
        "/var/log/migratorydata",
        "Server, access and message logs (JSON lines).",
        ".TP",
        "/var/lib/migratorydata",
        "Persistent state.",
        ".SH SEE ALSO",
        "\\fBsystemctl\\fR(1): the service is \\fBmigratorydata.service\\fR;",
        "/usr/share/doc/migratorydata/operations.md",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(sys.argv[1], sys.argv[2]))
