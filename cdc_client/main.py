"""``retina-cdc``: the CDC connector process.

The connector (sources, durable changelog, recovery driver) is not built
yet. Rather than pretend, the command refuses to start with a clear message
and exit code 2, so no deployment can mistake it for a running connector.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("retina-cdc: the CDC connector is not available in this build "
          "(see docs/operations.md, 'What is not built yet')", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
