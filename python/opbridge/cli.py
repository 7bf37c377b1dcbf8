"""The ``opbridge`` command line: ``opbridge serve ...`` (the operator service) and
``opbridge doctor`` and ``opbridge bench`` (see ``opbridge.doctor``, ``opbridge.bench``).

``serve`` runs the server binary shipped with the package (``opbridge/_bin/opbridge-serve``,
built by ``make build``; ``cargo build -p opbridge-serve --release`` builds the same binary for
containers). The process is replaced by the server, so signals sent to this PID reach it
directly. ``OPBRIDGE_SERVE_BIN`` names another binary.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

USAGE = """usage: opbridge <command> [options]

commands:
  serve    serve the operators over KServe V2 / Triton HTTP and gRPC (opbridge serve --help)
  bench    opbridge's operators against numpy, with --json and --plot (opbridge bench --help)
  doctor   check the installation, CPU, devices, JIT, plugins and a server (opbridge doctor --help)
"""


def server_binary() -> str | None:
    """The server binary: ``$OPBRIDGE_SERVE_BIN``, the package's own, or one on ``PATH``."""
    explicit = os.environ.get("OPBRIDGE_SERVE_BIN")
    if explicit:
        return explicit
    shipped = Path(__file__).resolve().parent / "_bin" / "opbridge-serve"
    if shipped.is_file() and os.access(shipped, os.X_OK):
        return str(shipped)
    return shutil.which("opbridge-serve")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ("doctor", "bench"):
        # By module path: `opbridge.doctor` the attribute is the function, not the module.
        from .bench import main as bench_main
        from .doctor import main as doctor_main

        try:
            return (doctor_main if command == "doctor" else bench_main)(rest)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            return e.code if isinstance(e.code, int) else 2
    if command != "serve":
        sys.stderr.write(f"opbridge: unknown command {command!r}\n{USAGE}")
        return 2
    binary = server_binary()
    if binary is None:
        sys.stderr.write(
            "opbridge serve: the server binary is not installed; build it with `make build` "
            "(or `cargo build -p opbridge-serve --release`) or set OPBRIDGE_SERVE_BIN\n"
        )
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(binary, [binary, *rest])
    except OSError as error:
        sys.stderr.write(f"opbridge serve: cannot run {binary}: {error}\n")
        return 2
    return 0  # not reached: execv replaced the process


if __name__ == "__main__":
    sys.exit(main())
