"""gunicorn settings for the gateway.

Started as ``gunicorn -c gateway/gunicorn.conf.py 'gateway:create_app()'``.

gevent workers: a model call can be held for minutes (long generations, hold mode), which
the sync worker class would time out or serialise.
"""

import sys

from app.config import ConfigError, service_config
from app.config.secrets import check_shared_secret  # light: no redis before gevent patches

_cfg = service_config()
try:  # started by the Procfile's line too, not only by `carryover serve gateway`
    check_shared_secret(_cfg, "gateway")
except ConfigError as _exc:
    sys.exit("\n".join(f"config error: {line}" for line in _exc.problems))

bind = f"{_cfg.gateway.host}:{_cfg.gateway.port}"
workers = int(_cfg.gateway.workers)
worker_class = "gateway.worker.GatewayWorker"  # gevent, without idle keep-alives holding a stop
worker_connections = 1000
timeout = int(_cfg.gateway.upstream_timeout_s) + 30
graceful_timeout = 10
keepalive = 30
accesslog = None
errorlog = "-"
loglevel = "info"
proc_name = "carryover-gateway"
# gunicorn's control socket has one default path per user: every gateway on a host (and any
# other gunicorn) would bind the same one, and the first to stop would remove it
control_socket_disable = True
