"""How every Retina server process starts: ``--config FILE``, then its TLS and failpoints.

:func:`load_process_config` parses the command line of ``retina-server``,
``retina-trans`` and ``retina-cdc`` (``--config``, default ``$RETINA_CONFIG``), loads
the configuration, applies its TLS settings to every channel the process opens and
arms the failpoints ``RETINA_FAILPOINTS`` names. It raises ConfigError or
FailpointError: the process then exits ``exit_codes.USAGE``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from retina_common import failpoints, tls
from retina_common.config import Config, load_config


def load_process_config(prog: str, description: str | None,
                        argv: Sequence[str] | None) -> tuple[Config, str | None]:
    """The process's configuration and the ``--config`` argument it came from."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    tls.configure(config.tls)
    failpoints.load_from_env()
    return config, args.config
