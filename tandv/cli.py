"""The ``tandv`` command: ``demo``, ``validate``, ``summary``, ``report``.

Errors a user can fix (a missing file, a file that is not a log) print one line
starting with ``tandv: error:`` and exit 1, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main"]


class CLIError(Exception):
    """An error shown to the user as one line."""


def _read(path: str):
    from .schema import SchemaError, read_log

    p = Path(path)
    if not p.exists():
        raise CLIError(f"no such file or directory: {path}")
    try:
        return read_log(p)
    except SchemaError as e:
        raise CLIError(f"{path} is not a valid tandv log: {e}") from None
    except FileNotFoundError as e:
        raise CLIError(str(e)) from None


def _cmd_validate(args: argparse.Namespace) -> int:
    df = _read(args.log)
    print(f"{args.log}: valid tandv log ({len(df)} rows, "
          f"{df[('metadata', 'step')].nunique()} steps, {df[('metadata', 'name')].nunique()} tensors)")
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    from .analysis import text_summary

    print(text_summary(_read(args.log)))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .viz.report import write_report

    out = write_report(_read(args.log), args.output, title=args.title or Path(args.log).name)
    print(f"tandv: report written to {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .analysis import text_summary
    from .schema import read_log

    if args.framework == "torch":
        from .demos.torch_demo import run
    else:
        from .demos.jax_demo import run
    path = run(steps=args.steps, out=args.out, seed=args.seed)
    print(f"tandv: log written to {path}")
    df = read_log(path)
    print(text_summary(df))
    if not args.no_report:
        try:
            from .viz.report import write_report
        except ImportError as e:  # plotting extras not installed
            print(f"tandv: no HTML report ({e}); install tandv[plot] for it", file=sys.stderr)
        else:
            report = write_report(df, Path(str(path).rstrip("/") + ".html"), title=f"tandv demo ({args.framework})")
            print(f"tandv: report written to {report}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tandv`` command."""
    parser = argparse.ArgumentParser(prog="tandv", description="Track and visualize training numerics.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="train a small transformer on CPU, tracking everything")
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's own)")
    p.add_argument("--out", default=None, help="log path (default: a new folder under tandv_logs/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("validate", help="check that LOG follows the tandv log schema")
    p.add_argument("log", help="a .pkl file, a .parquet file or a directory of parquet parts")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("summary", help="print a readable summary of LOG per tensor type")
    p.add_argument("log")
    p.set_defaults(func=_cmd_summary)

    p = sub.add_parser("report", help="write a self-contained HTML report of LOG")
    p.add_argument("log")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--title", default=None)
    p.set_defaults(func=_cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tandv`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"tandv: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tandv: interrupted", file=sys.stderr)
        return 130
