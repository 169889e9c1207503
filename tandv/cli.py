"""The ``tandv`` command: ``demo``, ``validate``, ``summary``, ``report``, ``diff``.

Errors a user can fix (a missing file, a file that is not a log, a damaged part) print
one line starting with ``tandv: error:`` and exit 1, without a traceback. Pickle logs
are read only with ``--trust-pickle``: unpickling runs code stored in the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")

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


def _guarded(path: str, read: Callable[[], T]) -> T:
    """``read()``, with the readers' failures turned into one-line CLI errors."""
    import pyarrow as pa

    from .schema import SchemaError

    try:
        return read()
    except SchemaError as e:
        raise CLIError(f"{path} is not a valid tandv log: {e}") from None
    except (OSError, pa.ArrowException) as e:  # missing parts, unreadable files
        raise CLIError(f"{path}: {e}") from None


def _read(path: str, trust_pickle: bool = False) -> pd.DataFrame:
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

    against = None if args.against is None else _read(args.against, args.trust_pickle)
    name = Path(args.log).name
    if against is not None:
        name = f"{name} against {Path(args.against).name}"
    out = write_report(
        _read(args.log, args.trust_pickle),
        args.output,
        title=args.title or name,
        against=against,
        against_title=str(args.against),
    )
    print(f"tandv: report written to {out}")
    return 0


def _parse_stats(text: str) -> list[str]:
    stats = [s.strip() for s in text.split(",") if s.strip()]
    if not stats:
        raise CLIError(
            f"--stats {text!r}: give statistic names separated by commas, e.g. rm2,max_abs"
        )
    return stats


def _cmd_diff(args: argparse.Namespace) -> int:
    from .compare import compare, divergence_in, most_different

    if not args.rtol >= 0:
        raise CLIError(f"--rtol {args.rtol}: expected a number >= 0")
    if args.top < 0:
        raise CLIError(f"--top {args.top}: expected a number >= 0")
    stats = _parse_stats(args.stats)
    a, b = _read(args.a, args.trust_pickle), _read(args.b, args.trust_pickle)
    try:
        table = compare(a, b, stats)
    except ValueError as e:
        raise CLIError(str(e)) from None
    first = divergence_in(table, args.rtol)
    shared = table[table["present"] == "both"]
    print(
        f"A: {args.a}\nB: {args.b}\n{len(shared)} (tensor, step) rows in both, compared on "
        f"{', '.join(stats)} (relative difference |a-b|/max(|a|,|b|), rtol {args.rtol:g})"
    )
    for which in ("a only", "b only"):
        only = table[table["present"] == which]
        if len(only):
            steps = only["step"]
            print(
                f"only in {which[0].upper()}: {len(only)} rows, "
                f"{only[['tensor_type', 'name']].drop_duplicates().shape[0]} tensors, steps "
                f"{int(steps.min())}..{int(steps.max())} (not compared)"
            )
    if shared.empty:
        print("nothing to compare: the logs share no (tensor, step)")
    elif first is None:
        print(f"no divergence: every shared tensor agrees within rtol {args.rtol:g}")
    else:
        values = "; ".join(
            f"{s} {first[f'{s}_a']:.6g} vs {first[f'{s}_b']:.6g} (rel {first[f'{s}_rel']:.3g})"
            for s in stats
        )
        print(
            f"first divergence: step {int(first['step'])}, {first['tensor_type']} "
            f"{first['name']!r}: {values}"
        )
    top = most_different(table, args.top)
    if args.top and len(top):
        print("\nmost different tensors (largest relative difference over steps and stats):")
        print(top.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
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
    p.add_argument(
        "--against",
        metavar="B",
        default=None,
        help="a second log: the report adds a section that overlays the two runs per layer "
        "and names where they first diverge",
    )
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser(
        "diff", help="compare two logs: where they first diverge and which tensors differ most"
    )
    p.add_argument("a", metavar="A", help=log_help)
    p.add_argument("b", metavar="B", help="the log to compare A with")
    p.add_argument(
        "--rtol",
        type=float,
        default=1e-3,
        help="relative difference above which a statistic diverges (default 1e-3)",
    )
    p.add_argument(
        "--stats", default="rm2,max_abs", help="statistics to compare (default rm2,max_abs)"
    )
    p.add_argument("--top", type=int, default=10, help="rows of the most-different table")
    p.add_argument("--trust-pickle", action="store_true", help=_TRUST_HELP)
    p.set_defaults(func=_cmd_diff)
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
