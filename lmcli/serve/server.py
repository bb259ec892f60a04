"""`lmcli serve`: bind, load the model, start the scheduler, serve until SIGTERM or Ctrl-C.

The port is bound before the model loads, so a port in use is a one-line error at once. On SIGTERM
(or SIGINT) no new request is admitted (503), the requests in flight have `shutdown_timeout` seconds to
finish, then whatever is left is cancelled, and the process exits 0.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcli.errors import LmcliError, UsageError

DEFAULT_PORT = 8000
DEFAULT_CONTEXT = 2048  # the longest row (prompt + max_tokens) by default, at most the model's context


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    batch_size: int | None = None  # None: jobs.default_batch_size (8 on CPU, 32 on GPU)
    max_queue: int = 64
    context: int | None = None
    max_body: int = 1 << 20
    request_timeout: float = 600.0
    shutdown_timeout: float = 10.0
    log_format: str = "text"


BEAM_KEYS = ("num_beams", "length_penalty", "early_stopping")


def served_defaults(defaults: Any) -> Any:
    """The model's own defaults (ModelDefaults) as the server uses them: without beam search, which the
    continuous batch does not do. Where the model's generation config asks for beams, a note says so once
    and a request decodes as `lmcli generate --num-beams 1` would; /v1/models lists these defaults, so a
    job sent with --server records what was done. A request's own beam fields are refused (400)."""
    import dataclasses

    beams = defaults.values.get("num_beams")
    if not any(key in defaults.values for key in BEAM_KEYS):
        return defaults
    if isinstance(beams, int) and beams > 1:
        sys.stderr.write(f"note: the model's {defaults.source or 'defaults'} asks for beam search (num_beams {beams}); "
                         "lmcli serve does not search with beams: requests decode as 'lmcli generate --num-beams 1'\n")
    return dataclasses.replace(defaults, values={k: v for k, v in defaults.values.items() if k not in BEAM_KEYS})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; LmcliError in one line when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LmcliError(f"cannot listen on {host}:{port}: the address is already in use "
                             "(another server? choose --port)") from None
        raise LmcliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(options: ServeOptions, load: Callable[[], tuple[Any, Any]], identity: Callable[[], dict], base: Any) -> None:
    """Serve until stopped. `load()` gives (model, tokenizer); `base`: the settings requests start from."""
    import uvicorn

    from lmcli.generation.continuous import use_continuous
    from lmcli.generation.prefix_cache import prefix_cache_for
    from lmcli.serve.app import ServerState, build_app
    from lmcli.serve.scheduler import Scheduler

    sock = bind(options.host, options.port)
    if not is_loopback(options.host) and not options.api_key:
        sys.stderr.write(f"warning: serving on {options.host} without an API key: anyone who can reach this "
                         "port can use the model; give --api-key (or LMCLI_API_KEY)\n")
    model, tokenizer = load()
    if not use_continuous(model):
        raise LmcliError("lmcli serve needs a model whose rows run continuously (a decoder-only model on the "
                         "batch-invariant path, without --tp, --fast-kernels or speculation)")
    from lmcli.jobs.runner import default_batch_size

    batch_size = options.batch_size or default_batch_size(model)
    max_positions = model.config.max_position_embeddings
    context = min(options.context or DEFAULT_CONTEXT, max_positions)
    model_record = identity()
    scheduler = Scheduler(model, tokenizer, batch_size, options.max_queue, context,
                          prefix_cache=prefix_cache_for(model))
    state = ServerState(scheduler, tokenizer, model.config.vocab_size, base, model_record["name"],
                        model_record["fingerprint"], context, max_body=options.max_body,
                        timeout=options.request_timeout, api_key=options.api_key or None,
                        log_format=options.log_format, model_record=model_record)
    scheduler.start()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not state.draining:
                state.draining = True
                scheduler.stop_admitting()
                # The requests in flight may finish within the bound; then they are ended (503, or an
                # error event that ends a stream), so that uvicorn's own cancelling is only a backstop.
                timer = threading.Timer(options.shutdown_timeout, scheduler.abort)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(state), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=round(options.shutdown_timeout) + 5)
    server = Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    sys.stderr.write(f"lmcli serve: {model_record['name']} on http://{shown}:{port}/v1 "
                     f"(batch {batch_size}, queue {options.max_queue}, context {context})\n")
    sys.stderr.flush()
    # uvicorn raises the signal it stopped on again once it is done; with these handlers that is a no-op,
    # so the process ends here, exiting 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.stop(options.shutdown_timeout)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if scheduler.error is not None:
        sys.stderr.write(f"warning: the scheduler failed once: {type(scheduler.error).__name__}: {scheduler.error}\n")
    if scheduler.thread.is_alive():
        # Still inside one forward (a long prompt's prefill, or a cold first step on a busy machine), which
        # nothing can interrupt: the interpreter's exit would tear torch down under it and abort the process
        # ("terminate called without an active exception", exit -6). Its rows were ended already; leave now.
        sys.stderr.write(f"lmcli serve: the model was still in a step {options.shutdown_timeout:g} s after the "
                         "shutdown began (--shutdown-timeout); exiting without waiting for it\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(0)
