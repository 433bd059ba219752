"""EdgeTrain shared core: role-free code imported by both the coordinator and the edge client.

- ``catalog.py``   what a job can name (models, datasets, codecs) and the specs that pick them,
                   without torch, so job files are checked without it.
- ``config/``     job configuration (keyword-only dataclasses), the one YAML loader and the
                   mapping -> checked dataclass conversion every config file uses.
- ``transport.py`` every gRPC server, channel, credential, retry and resumable transfer.
- ``serde.py``     conversions between plain data and the wire messages.
- ``errors.py``    typed reasons that cross the wire (refusals, board failures).
- ``streaming.py`` bundles on the wire without torch: tensor metadata, checksummed chunks.
- ``tensors.py``   named tensors packed into one payload and back.
- ``discovery.py`` mDNS browsing: find coordinators and job servers without an address.
- ``supervisor.py`` start, watch and stop role processes: address files, adoption, terminate.
- ``job_client.py`` the one job-server client (retries, a Submit's idempotency key).
- ``models.py``    CIFAR ResNet-18 / MobileNetV2 / a BN-free small CNN as ordered block lists,
                   with per-block parameter count, FLOPs and activation size.
- ``cifar_nets.py`` ResNet-18 and MobileNetV2 for 32x32 images, as torchvision defines them
                   (a board needs no torchvision).
- ``data.py``      the datasets a job trains on (synthetic, CIFAR-10, imported ones);
                   deterministic batch assembly and augmentation.
- ``datastore.py`` imported datasets as stored: uint8 blocks with a manifest of sha256 sums.
- ``dataset_import.py`` `edgetrain data import|list`: CIFAR-10, CIFAR-format sets, image folders.
- ``image_folder.py`` image folders (one sub-folder per class) decoded once into 32x32 arrays.
- ``versions.py``  which torch a board may train with, and what mixed versions mean.
- ``split.py``     how a global batch is divided across devices (proportional / equal).
- ``training.py``  the gradient computation (and a federated round's local training) both roles
                   and the reference tests share.
- ``compression.py`` update codecs (fp16 / bf16 / int8 / top-k) with error feedback.
- ``updates.py``   wire layouts of a compressed update (up) and of parameter deltas (down).
- ``pipeline.py``  pipeline schedules (GPipe, 1F1B), stage blocks, row splits of micro-batches.
- ``sampling.py``  which sample indices make up each step (every sample once per epoch).
- ``telemetry.py`` a board's telemetry sample (None = unknown).
- ``speed_reference.py`` the fixed workload a job server times boards with.
- ``board_hardware.py`` the seams a board computes through (compute throttle, memory, link
                   shaper, battery, energy) with a real board's defaults; its real battery.
- ``fleet_file.py`` what a fleet is (boards, links, batteries, gateway, events): fleet and
                   board files, read by the planner, the job server and the emulator.

The layer above the roles (it may import them; no role imports it):

- ``emulator/``    the emulated fleet: fleet up/down, namespaces, CPU quotas, links, batteries,
                   emulated boards, local runs, light boards and the job-scheduling simulator.
- ``experiment/``  experiments against baselines, their results and plots.
- ``cli.py``       the ``edgetrain`` command: its parser and dispatch; ``commands/`` holds its
                   handlers (one module per group of commands).
"""

__version__ = "0.1.0"

PROTOCOL_VERSION = 3
"""Wire protocol version; the coordinator refuses clients that speak another."""

TORCH_FLOOR = "2.5.0a0"
"""The oldest torch a board may train with: JetPack 6.1's NVIDIA build (2.5.0a0+...nv24.08) and
every later release (edgetrain.versions; pyproject.toml asks for the same floor)."""

SERVICE_TYPE = "_edgetrain._tcp.local."
"""The DNS-SD (mDNS) service type a coordinator advertises and boards browse for."""
