"""Compiles the kernel cases of a preset for one target and prints one JSON line per case.

Run inside the target's compiler venv (``venv.py``), e.g.::

    JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=0 ~/.cache/jpaged/aot/gpu/bin/python \
        -m pallas_kernels.aot.sweep --target h100 --preset cross_section

Each line: ``{"target", "case", "ok", "error", "seconds", "memory", "spills"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pallas_kernels.aot import cases as cases_lib
from pallas_kernels.aot import targets
from pallas_kernels.aot.compile import compile_for


def sweep(target: str, preset: str, only: str | None = None, out=sys.stdout) -> list[dict]:
    """Compiles every case of ``preset`` (names containing ``only``, when given) for ``target``;
    writes and returns one record per case."""
    t = targets.get(target)
    backend = "tpu" if t.platform == "tpu" else "gpu"
    records = []
    for case in cases_lib.cases_for(preset, t.kv_dtypes):
        if only and only not in case.name:
            continue
        fn, args, donate = case.build(backend)
        result = compile_for(target, fn, *args, donate_argnums=donate)
        record = dict(target=target, case=case.name, **dataclasses.asdict(result))
        records.append(record)
        print(json.dumps(record), file=out, flush=True)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=sorted(targets.TARGETS))
    parser.add_argument("--preset", default="cross_section", choices=sorted(cases_lib.PRESETS))
    parser.add_argument("--only", default=None, help="compile only cases whose name contains this")
    args = parser.parse_args(argv)
    records = sweep(args.target, args.preset, args.only)
    failed = [r["case"] for r in records if not r["ok"]]
    print(f"{args.target}: {len(records) - len(failed)} of {len(records)} compiled", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
