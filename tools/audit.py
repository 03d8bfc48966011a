#!/usr/bin/env python
"""Check a recipe on the CPU for what would break or stall it on CUDA: ``tools/audit.py config=NAME [key=value]``.

Runs a few real train steps and lists, with file and line, every tensor made without a device
and every host-device sync inside the step (sslkit/launch/audit.py). Exit 0 when nothing is found, 1
otherwise, 2 for a bad config.
"""

import sys

from sslkit.launch.runtime import reexec_with_tuned_malloc, run_entry

reexec_with_tuned_malloc()  # before torch is imported


def main(argv: list[str]) -> int:
    """Audit the recipe ``argv`` names and print the findings."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    import logging

    from sslkit import registry as R
    from sslkit.config.schema import ConfigError
    from sslkit.launch.audit import audit_recipe

    logging.getLogger("sslkit").setLevel(logging.WARNING)
    try:
        findings = audit_recipe(argv)
    except (ConfigError, R.UnknownNameError) as exc:
        print(f"sslkit: config error: {exc}", file=sys.stderr)
        return 2
    for finding in findings:
        print(finding)
    print(f"{len(findings)} finding(s) in 3 train steps" + ("" if findings else ": ready for CUDA as far as a CPU "
                                                             "can tell"))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(run_entry(lambda: main(sys.argv[1:])))
