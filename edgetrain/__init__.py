"""EdgeTrain shared core: role-free code imported by both the coordinator and the edge client.

- ``catalog.py``   what a job can name (models, datasets, codecs) and the specs that pick them,
                   without torch, so job files are checked without it.
- ``models.py``    CIFAR ResNet-18 / MobileNetV2 / a BN-free small CNN as ordered block lists,
                   with per-block parameter count, FLOPs and activation size.
- ``data.py``      CIFAR-10 loader and a deterministic, learnable synthetic CIFAR-shaped dataset;
                   deterministic batch assembly and augmentation.
- ``tensors.py``   named-tensor bundles as dtype + shape + raw bytes, checksummed chunking.
- ``grpc_options.py`` every channel and server option, each with its reason.
- ``config.py``    job configuration (keyword-only dataclasses) and YAML loading.
- ``split.py``     how a global batch is divided across devices (proportional / equal).
- ``training.py``  the gradient computation (and a federated round's local training) both roles
                   and the reference tests share.
- ``compression.py`` update codecs (fp16 / bf16 / int8 / top-k) with error feedback.
- ``updates.py``   wire layouts of a compressed update (up) and of parameter deltas (down).
- ``pipeline.py``  pipeline schedules (GPipe, 1F1B), stage blocks, row splits of micro-batches.
- ``sampling.py``  which sample indices make up each step (every sample once per epoch).
- ``serde.py``     conversions between plain data and the wire messages.
- ``telemetry.py`` a board's telemetry sample (None = unknown).
- ``throttle.py``  emulated CPU speed: cgroup v1 quota as root, duty-cycle throttle otherwise.
- ``shaping.py``   application-level link emulation (rate, delay, loss).
- ``battery.py``   emulated battery draining with work; the real battery through psutil.
- ``netns.py``     a virtual LAN of network namespaces on a bridge with tc tbf links (root).
- ``fleet_config.py``, ``fleet.py``  emulated fleets: YAML, supervisor, `fleet up/down`.
- ``launch.py``    starts coordinator and client processes for local runs (never imports a role).
- ``cli.py``       the ``edgetrain`` command; the only module here that imports a role.
"""

__version__ = "0.1.0"

PROTOCOL_VERSION = 2
"""Wire protocol version; the coordinator refuses clients that speak another."""

SERVICE_TYPE = "_edgetrain._tcp.local."
"""The DNS-SD (mDNS) service type a coordinator advertises and boards browse for."""
