"""python -m pallas_kernels.cpu_native --build [--march X]: builds every native CPU kernel that this CPU (or
-march=X) can run, into the cache (build.py), and prints each kernel's status. Exit status 1 if a build failed (a
kernel whose instruction set is not targeted, or JAXPAGED_NATIVE=0, is reported, not a failure)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.cpu_native", description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="build every kernel missing from the cache and print each "
                        "kernel's status")
    parser.add_argument("--march", help="build for -march=MARCH instead of this CPU (sets JAXPAGED_NATIVE_MARCH)")
    args = parser.parse_args(argv)
    if args.march:
        os.environ["JAXPAGED_NATIVE_MARCH"] = args.march
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pallas_kernels.cpu_native import build

    if not args.build:
        parser.print_help()
        return 0
    print(f"compiler flags: {' '.join(build.flags())}; cache: {build.cache_dir()}")
    failed = False
    for name, status in build.statuses().items():
        kernel = build.KERNELS[name]
        if status.ok:
            how = f"built in {status.built_seconds:.1f} s" if status.built_seconds else "cached"
            print(f"  {name:<10} native ({how}): {kernel.what}; {status.path}")
        else:
            failed |= not status.skipped
            print(f"  {name:<10} unavailable: {status.reason}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
