"""``pakv-onnx serve FOLDER --replicas N``: the same app as a Ray Serve deployment of N replicas, each its
own og.Engine in its own Ray actor process, behind Ray Serve's HTTP proxy (which routes each request to
a replica). No router, queue or cluster manager of our own.

Without ``--address`` a local Ray instance starts with just enough resources (CPUs for the replicas, a
small object store: requests and tokens never pass through it) and stops with the command. With
``--address`` (``auto``: the cluster ``ray start --head`` started on this machine; ``ray://HOST:10001``
a remote one) the replicas go wherever the cluster places them; FOLDER must then be readable at the
same path on every node.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from pakv_onnx.serve.server import READY, ServeOptions, build_replica_app

APP_NAME = "pakv-serve"
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # Ray's default is 30% of memory; nothing large goes through it


def deployment(options: ServeOptions, replicas: int):
    """The Ray Serve application: ``replicas`` replicas, each building the app over its own engine."""
    from ray import serve

    cpus = float(options.threads or 1)

    def build():  # a plain function: Ray Serve calls a builder on each replica (a partial would pass as the app)
        return build_replica_app(options)

    ingress = serve.ingress(build)
    cls = serve.deployment(
        ingress(), name="pakv-onnx", num_replicas=replicas, ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=options.max_queue + 64,
    )  # fmt: skip
    return cls.bind()


def start_ray(replicas: int, address: str | None, threads: int | None) -> None:
    import ray

    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=replicas * (threads or 1), object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False, log_to_driver=False,
        )  # fmt: skip


def serve_replicas(
    options: ServeOptions,
    replicas: int,
    address: str | None,
    stop: threading.Event | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> int:
    """Deploy, print the ready line, wait for SIGINT / SIGTERM (or ``stop``, or ``stop_requested()``: a
    SIGINT that came while Ray started), then shut Serve and the local Ray instance down; returns 0."""
    import ray
    from ray import serve

    stop = stop or threading.Event()
    previous: dict = {}
    try:
        start_ray(replicas, address, options.threads)
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(deployment(options, replicas), name=APP_NAME, route_prefix="/")
        # After ray.init, which installs its own fatal-signal handler for SIGTERM (an abort, exit -6).
        previous = {
            sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        print(f"{READY} {options.folder.resolve().name} on http://{options.host}:{options.port}/v1 "
              f"({replicas} replicas behind Ray Serve's proxy)", flush=True)  # fmt: skip
        while not stop.wait(0.5) and not stop_requested():
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print("pakv-onnx serve: stopped", flush=True)
    return 0
