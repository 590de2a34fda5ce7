"""`draft-service`: serve draft tokens to a target service (flags: draft-service --help)."""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from draft_service.config import parse_config
from draft_service.server import serve
from tandem.grpc_server import install_event_loop, set_torch_threads

log = logging.getLogger("draft_service")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_torch_threads(config.threads)
    install_event_loop()
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError) as e:  # unknown model, bad checkpoint, port taken
        log.error("cannot serve: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
