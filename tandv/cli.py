"""The ``tandv`` command: ``demo``, ``validate``, ``summary``, ``report``.

Errors a user can fix (a missing file, a file that is not a log, a damaged part) print
one line starting with ``tandv: error:`` and exit 1, without a traceback. Pickle logs
are read only with ``--trust-pickle``: unpickling runs code stored in the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

_TRUST_HELP = (
    "read a .pkl/.pickle LOG: unpickling runs code stored in the file, so give this only "
    "for pickles you made or trust (parquet logs are data only and need no flag)"
)


class CLIError(Exception):
    """An error shown to the user as one line."""


def _printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (escape sequences from tensor
    names or paths, say) written as Python escapes, newlines kept."""
    return "".join(
        c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode() for c in text
    )


def _check(path: str, trust_pickle: bool) -> Path:
    """``path`` if it exists, and is not a pickle read without ``--trust-pickle``."""
    p = Path(path)
    if not p.exists():
        raise CLIError(f"no such file or directory: {path}")
    if p.suffix.lower() in (".pkl", ".pickle") and not trust_pickle:
        raise CLIError(
            f"{path} is a pickle, and reading a pickle runs code stored in it; pass "
            f"--trust-pickle if you made it or trust its source"
        )
    return p


def _guarded(path: str, read):
    """``read()``, with the readers' failures turned into one-line CLI errors."""
    import pyarrow as pa

    from .schema import SchemaError

    try:
        return read()
    except SchemaError as e:
        raise CLIError(f"{path} is not a valid tandv log: {e}") from None
    except (OSError, pa.ArrowException) as e:  # missing parts, unreadable files
        raise CLIError(f"{path}: {e}") from None


def _read(path: str, trust_pickle: bool = False):
    from .schema import read_log

    p = _check(path, trust_pickle)
    return _guarded(path, lambda: read_log(p, trust_pickle=True))  # _check asked for it


def _cmd_validate(args: argparse.Namespace) -> int:
    from .schema import read_log, read_parquet_chunks
    from .schema.columns import METADATA

    p = _check(args.log, args.trust_pickle)

    def count() -> tuple[int, int, int]:
        chunks = (
            [read_log(p, trust_pickle=True)]
            if p.suffix.lower() in (".pkl", ".pickle")
            else read_parquet_chunks(p)
        )
        rows, steps, names = 0, set(), set()
        for df in chunks:  # a parquet log in chunks: memory stays flat
            rows += len(df)
            steps.update(df[(METADATA, "step")].unique().tolist())
            names.update(df[(METADATA, "name")].unique().tolist())
        return rows, len(steps), len(names)

    rows, steps, names = _guarded(args.log, count)
    print(_printable(f"{args.log}: valid tandv log ({rows} rows, {steps} steps, {names} tensors)"))
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    from .analysis import summarize_log

    p = _check(args.log, args.trust_pickle)
    print(_printable(_guarded(args.log, lambda: summarize_log(p, trust_pickle=True))))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .viz.report import write_report

    out = write_report(
        _read(args.log, args.trust_pickle), args.output, title=args.title or Path(args.log).name
    )
    print(f"tandv: report written to {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .analysis import text_summary
    from .schema import read_log

    if args.framework == "torch":
        from .demos.torch_demo import run as run_torch

        path = run_torch(steps=args.steps, out=args.out, seed=args.seed)
    else:
        from .demos.jax_demo import run as run_jax

        path = run_jax(steps=args.steps, out=args.out, seed=args.seed)
    print(f"tandv: log written to {path}")
    df = read_log(path, trust_pickle=True)  # the log this command just wrote
    print(text_summary(df))
    if not args.no_report:
        try:
            from .viz.report import write_report
        except ImportError as e:  # plotting extras not installed
            print(f"tandv: no HTML report ({e}); install tandv[plot] for it", file=sys.stderr)
        else:
            report = write_report(
                df, Path(str(path).rstrip("/") + ".html"), title=f"tandv demo ({args.framework})"
            )
            print(f"tandv: report written to {report}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tandv`` command."""
    parser = argparse.ArgumentParser(
        prog="tandv",
        description="Track and visualize training numerics.",
        epilog="Warning: a .pkl/.pickle log is read by unpickling, which runs code stored in "
        "the file; the commands read one only with --trust-pickle. Parquet logs hold data only.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="train a small transformer on CPU, tracking everything")
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument(
        "--steps", type=int, default=None, help="training steps (default: the demo's own)"
    )
    p.add_argument("--out", default=None, help="log path (default: a new folder under tandv_logs/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.set_defaults(func=_cmd_demo)

    log_help = (
        "a directory of parquet parts, a .parquet file, or a .pkl/.pickle file "
        "(read only with --trust-pickle)"
    )
    p = sub.add_parser("validate", help="check that LOG follows the tandv log schema")
    p.add_argument("log", help=log_help)
    p.add_argument("--trust-pickle", action="store_true", help=_TRUST_HELP)
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("summary", help="print a readable summary of LOG per tensor type")
    p.add_argument("log", help=log_help)
    p.add_argument("--trust-pickle", action="store_true", help=_TRUST_HELP)
    p.set_defaults(func=_cmd_summary)

    p = sub.add_parser("report", help="write a self-contained HTML report of LOG")
    p.add_argument("log", help=log_help)
    p.add_argument("--trust-pickle", action="store_true", help=_TRUST_HELP)
    p.add_argument(
        "-o", "--output", default="report.html", help="HTML file to write (default report.html)"
    )
    p.add_argument("--title", default=None)
    p.set_defaults(func=_cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tandv`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"tandv: error: {_printable(' '.join(str(e).split()))}", file=sys.stderr)  # one line
        return 1
    except KeyboardInterrupt:
        print("tandv: interrupted", file=sys.stderr)
        return 130
