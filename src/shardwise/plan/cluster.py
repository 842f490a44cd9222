"""The machines a plan is for: presets for common GPUs, and "this machine" once calibrated.

A ``Cluster`` is ``nodes`` x ``procs_per_node`` ranks, each with ``device_memory`` bytes,
``peak_tflops`` of dense matrix arithmetic in 16 bits (``fp32_tflops`` in 32), and links:
``intra_gbps`` between the ranks of a node, ``inter_gbps`` per rank across nodes (GB/s of bus
bandwidth, what a ring collective sustains), ``latency_us`` per collective. Three fractions
turn peaks into times: ``efficiency`` (what a transformer layer reaches of the peak),
``overlap`` (the share of data-parallel traffic hidden behind backward) and the optimizer's
``optimizer_gbps`` (bytes of model state an update reads and writes per second; calibrated,
with ``optimizer_tensor_us``, the fixed cost of each parameter tensor's kernels).

A calibration (``shardwise plan --calibrate``, calibrate.py) measures these on the real
backend at several sizes and process counts; its fits replace the preset's peaks, per
operation and per group size.

Where each preset number comes from is in ``SOURCES`` (vendor datasheets for peaks, memory and
links); the ones nobody measured for shardwise are listed in ``Cluster.estimated``, and a
plan's record whose time depends on one of them says ``"estimate": true`` (``estimated``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GIB = 1 << 30


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int = 1
    procs_per_node: int = 8
    device_memory: int = 80 * GIB
    peak_tflops: float = 312.0
    fp32_tflops: float = 19.5
    intra_gbps: float = 230.0
    inter_gbps: float = 23.0
    latency_us: float = 10.0
    efficiency: float = 0.55
    overlap: float = 0.8
    optimizer_gbps: float = 1000.0
    host_gbps: float = 20.0  # offload: device <-> host per rank
    host_optimizer_gbps: float = 20.0  # the optimizer step in host memory
    optimizer_tensor_us: float = 0.0  # calibrated: the update's fixed cost per parameter tensor
    # Calibrated fits: op -> group size -> [latency s, bytes/s]; processes -> TFLOP/s.
    collectives: dict = field(default_factory=dict)
    compute: dict = field(default_factory=dict)
    layer_overhead_us: float = 0.0  # fixed cost of a layer's forward + backward, per micro-batch
    layer_overheads_us: dict = field(default_factory=dict)  # calibrated: the same per processes
    layer_ops: float = 0.0  # calibrated: aten ops of the timed block's forward (timing.py)
    cores: int = 0  # CPU cores the ranks share (a calibrated CPU machine; 0: one device each)
    # Calibrated: what each tensor-parallel collective costs beyond its ring fit, per group
    # size (calibrate_fits.tp_call_fit), and each fit's largest relative error at its points.
    tp_call_us: dict = field(default_factory=dict)
    tp_compute: dict = field(default_factory=dict)  # split arithmetic's excess over 1/tp
    # Calibrated: how far apart n ranks leave a barrier (the last's exit - the first's), us.
    start_skew_us: dict = field(default_factory=dict)
    # The same for a context-parallel attention call, per method and group size
    # (calibrate_fits.cp_call_fit): seconds beyond its messages, and its arithmetic's excess.
    cp_call_us: dict = field(default_factory=dict)
    cp_compute: dict = field(default_factory=dict)
    # Calibrated: what running a block's backward as B and W (the zero-bubble schedules)
    # adds to its forward + backward, per calibration block's worth of ops (timing.py).
    split_overhead_us: float = 0.0
    split_flops_rate: float = 0.0  # calibrated: the same grows by weighted FLOPs / this
    fit_errors: dict = field(default_factory=dict)
    estimated: tuple[str, ...] = ()  # fields not measured (SOURCES says why each is what it is)

    def __post_init__(self) -> None:  # a JSON list read back is the same tuple
        object.__setattr__(self, "estimated", tuple(self.estimated))

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    def share(self) -> float:
        """How many ranks take turns on each core: procs_per_node / cores when the ranks
        share fewer CPU cores (a calibrated CPU machine), else 1."""
        return max(1.0, self.procs_per_node / self.cores) if self.cores else 1.0

    def tflops(self, precision: str) -> float:
        """Sustained TFLOP/s of one rank on transformer layers: the GEMM rate x efficiency.

        Calibrated, the rate is the one measured with the process count nearest
        ``procs_per_node`` all busy at once, capped at the cores: more ranks than cores take
        turns, rate x cores / procs_per_node (measured with every rank busy at once, a
        shared core looked slower still than turns make it in a step, where ranks also wait).
        """
        measured = self.compute.get(precision) or self.compute.get("fp32")
        if measured:
            by_procs = {int(k): v for k, v in measured.items()}
            want = min(self.procs_per_node, self.cores) if self.cores else self.procs_per_node
            n = min(by_procs, key=lambda k: abs(k - want))
            return by_procs[n] * n / max(self.procs_per_node, n) * self.efficiency
        peak = self.fp32_tflops if precision == "fp32" else self.peak_tflops
        return peak * self.efficiency

    def layer_cost_s(self) -> float:
        """Seconds a layer's forward + backward costs beyond its FLOPs, per micro-batch, on
        one rank with a core of its own: calibrated, the fit of the process count nearest
        ``procs_per_node`` (capped at the cores, as ``tflops``); else ``layer_overhead_us``."""
        if not self.layer_overheads_us:
            return self.layer_overhead_us * 1e-6
        by_procs = {int(k): v for k, v in self.layer_overheads_us.items()}
        want = min(self.procs_per_node, self.cores) if self.cores else self.procs_per_node
        return by_procs[min(by_procs, key=lambda k: abs(k - want))] * 1e-6

    def collective_time(self, op: str, payload: int, n: int, inter: bool) -> float:
        """Seconds for one call of ``op`` with ``payload`` bytes on ``n`` ranks (ring model)."""
        if n <= 1:
            return 0.0
        ring = {"all_reduce": 2.0 * (n - 1) / n, "send": 1.0, "recv": 0.0}.get(op, (n - 1) / n)
        fit = self.collectives.get(op, {})
        if fit:
            sizes = {int(k): v for k, v in fit.items()}
            lat, bw = sizes[min(sizes, key=lambda k: abs(k - n))]
            return lat + ring * payload / bw
        steps = 2 * (n - 1) if op == "all_reduce" else max(n - 1, 1)
        gbps = self.inter_gbps if inter else self.intra_gbps
        return steps * self.latency_us * 1e-6 + ring * payload / (gbps * 1e9)

    def call_wait(self, n: int) -> float:
        """Seconds a blocking collective of ``n`` ranks issued between kernels costs beyond
        its ring fit: the calibrated wait of an all-reduce between compute segments (the
        nearest calibrated group size; the tensor-parallel fit's per-call cost), charged on
        every kind (timing.CALL_WAIT: timed per kind, an all-to-all on 4 ranks waited about
        half a ring all-reduce between equal segments, yet charged so the two sweeps of
        2026-11-29 fitted worse: 75 and 83 of ~100 layouts within 15% with one wait, 70 and
        82 with one per kind). Not multiplied by the share of ranks on a core: calibrated
        with every rank busy and stored per core (÷ n / cores), the wait is paid once per
        call; a rank waiting on its peer hands its core to another (idle sweep of session
        41: x share put 4-rank TP layouts on 2 cores 24-41% too slow, per core within 4%)."""
        if n <= 1 or not self.tp_call_us:
            return 0.0
        by_n = {int(k): v for k, v in self.tp_call_us.items()}
        return by_n[min(by_n, key=lambda k: abs(k - n))] * 1e-6

    def start_skew(self, n: int) -> float:
        """Seconds between the first and the last of ``n`` ranks resuming after a collective
        (calibrated: leaving a barrier, the nearest process count; 0 uncalibrated). A step
        starts so (the previous step's last collective, a benchmark's barrier): its work
        runs from the last rank's start, its time is counted from the first's. 4 ranks on 2
        cores resume ~0.3-0.65 ms apart (a woken rank waits for a core; single steps traced
        up to 4.4 ms), 2 on 2 about nothing."""
        if n <= 1 or not self.start_skew_us:
            return 0.0
        by_n = {int(k): v for k, v in self.start_skew_us.items()}
        return by_n[min(by_n, key=lambda k: abs(k - n))] * 1e-6

    def tp_compute_factor(self, n: int) -> float:
        """How much longer a rank's 1/n of a split layer's arithmetic takes than 1/n of the
        whole (calibrated, nearest group size; 1 uncalibrated or unsplit)."""
        if n <= 1 or not self.tp_compute:
            return 1.0
        by_n = {int(k): v for k, v in self.tp_compute.items()}
        return 1.0 + by_n[min(by_n, key=lambda k: abs(k - n))]

    def cp_call_time(self, method: str, n: int) -> tuple[float, float]:
        """(seconds, arithmetic excess) a context-parallel attention call of ``method`` on
        ``n`` ranks costs beyond its messages and 1/rate arithmetic, forward + backward (the
        nearest calibrated group size; (0, 0) uncalibrated). Unlike ``call_wait``'s
        waits, this is mostly work (the ring's merges and copies, the per-block kernels'
        fixed costs), which ranks sharing a core do in turns: x share (idle table of
        session 40 re-predicted: 4-rank CP layouts on 2 cores 20-32% too fast per core,
        0-12% x share)."""
        us, ks = self.cp_call_us.get(method, {}), self.cp_compute.get(method, {})
        if n <= 1 or not us:
            return 0.0, 0.0
        near = str(min((int(k) for k in us), key=lambda k: abs(k - n)))
        return us[near] * 1e-6 * self.share(), ks.get(near, 0.0)

    def estimated_for(self, offload: bool, comm: bool, data: bool) -> list[str]:
        """The unmeasured numbers a layout's time depends on (``comm``: it communicates;
        ``data``: data-parallel traffic, which ``overlap`` hides; ``offload``: host links)."""
        used = {"peak_tflops", "fp32_tflops", "efficiency", "optimizer_gbps"}
        used |= {"intra_gbps", "inter_gbps", "latency_us"} if comm else set()
        used |= {"overlap"} if data else set()
        used |= {"host_gbps", "host_optimizer_gbps"} if offload else set()
        return sorted(used & set(self.estimated))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


# Where each preset number comes from (GB/s: bus bandwidth a ring collective sustains per
# rank, one direction). "estimate:" marks the numbers no measurement backs (Cluster.estimated).
_A100 = {
    "device_memory": "NVIDIA A100 datasheet: 80 GB HBM2e (SXM)",
    "peak_tflops": "NVIDIA A100 datasheet: 312 TFLOP/s BF16/FP16 tensor core, dense",
    "fp32_tflops": "NVIDIA A100 datasheet: 19.5 TFLOP/s FP32 (no TF32)",
    "intra_gbps": "NVLink 3: 300 GB/s per direction; estimate: 230 is the NCCL all-reduce "
    "bus bandwidth commonly reported for DGX A100, not measured by shardwise",
    "inter_gbps": "estimate: one 200 Gb/s HDR InfiniBand port per GPU (25 GB/s) at ~90%",
    "latency_us": "estimate: a few microseconds per NCCL ring step, rounded up",
    "efficiency": "estimate: share of the peak a transformer layer sustains (Megatron-LM "
    "reports 40-55% end to end on A100s), not measured for shardwise",
    "overlap": "estimate: share of data-parallel traffic hidden behind backward",
    "optimizer_gbps": "estimate: AdamW streams model states at ~half of HBM's 2 TB/s",
    "host_gbps": "estimate: PCIe 4.0 x16 (32 GB/s per direction) at ~60%",
    "host_optimizer_gbps": "estimate: a CPU AdamW over host memory",
}
SOURCES = {
    "a100-80g": _A100,
    "a100-40g": {**_A100, "device_memory": "NVIDIA A100 datasheet: 40 GB HBM2 (SXM)"},
    "h100-80g": {
        **_A100,
        "device_memory": "NVIDIA H100 datasheet: 80 GB HBM3 (SXM)",
        "peak_tflops": "NVIDIA H100 datasheet: 989 TFLOP/s BF16/FP16 tensor core, dense (SXM)",
        "fp32_tflops": "NVIDIA H100 datasheet: 67 TFLOP/s FP32 (SXM)",
        "intra_gbps": "NVLink 4: 450 GB/s per direction; estimate: 360 at ~80% bus bandwidth",
        "inter_gbps": "estimate: one 400 Gb/s NDR InfiniBand port per GPU (50 GB/s) at ~90%",
    },
    "v100-32g": {
        **_A100,
        "device_memory": "NVIDIA V100 datasheet: 32 GB HBM2 (SXM2)",
        "peak_tflops": "NVIDIA V100 datasheet: 125 TFLOP/s FP16 tensor core (SXM2)",
        "fp32_tflops": "NVIDIA V100 datasheet: 15.7 TFLOP/s FP32 (SXM2)",
        "intra_gbps": "NVLink 2: 150 GB/s per direction; estimate: 130 at ~85% bus bandwidth",
        "inter_gbps": "estimate: one 100 Gb/s EDR InfiniBand port per GPU (12.5 GB/s) at ~80%",
    },
}


def _unmeasured(name: str) -> tuple[str, ...]:
    return tuple(sorted(k for k, v in SOURCES[name].items() if "estimate" in v))


PRESETS = {
    "a100-80g": Cluster("a100-80g", estimated=_unmeasured("a100-80g")),
    "a100-40g": Cluster("a100-40g", device_memory=40 * GIB, estimated=_unmeasured("a100-40g")),
    "h100-80g": Cluster(
        "h100-80g",
        peak_tflops=989.0,
        fp32_tflops=67.0,
        intra_gbps=360.0,
        inter_gbps=45.0,
        estimated=_unmeasured("h100-80g"),
    ),
    "v100-32g": Cluster(
        "v100-32g",
        device_memory=32 * GIB,
        peak_tflops=125.0,
        fp32_tflops=15.7,
        intra_gbps=130.0,
        inter_gbps=10.0,
        estimated=_unmeasured("v100-32g"),
    ),
}


def default_calibration_path() -> Path:
    return Path.home() / ".cache" / "shardwise" / "calibration.json"


def load(spec: str) -> Cluster:
    """A preset name, ``this-machine`` (the saved calibration) or a calibration JSON file."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = default_calibration_path() if spec in ("this-machine", "local") else Path(spec)
    if not path.exists():
        hint = "run `shardwise plan --calibrate` first" if spec in ("this-machine", "local") else ""
        known = ", ".join([*PRESETS, "this-machine", "a calibration .json"])
        raise ValueError(f"--cluster {spec!r}: no such preset or file ({known}) {hint}".strip())
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--cluster {spec!r}: not a readable preset JSON ({e})") from None
    unknown = (
        sorted(set(data) - set(Cluster.__dataclass_fields__)) if isinstance(data, dict) else []
    )
    if not isinstance(data, dict) or unknown:
        raise ValueError(
            f"--cluster {spec!r}: not a preset (unknown keys {unknown}); "
            "write one with `shardwise plan --calibrate --output FILE`"
        )
    return Cluster(**data)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """``80GiB``, ``40GB``, ``512MiB``, ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"--device-memory {text!r}: give a size like 80GiB, 40GB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def with_overrides(base: Cluster, **given: object) -> Cluster:
    """``base`` with the flags the user gave (None: keep the preset's). A flag wins over a
    calibration: --peak-tflops drops the measured compute rates, a link flag the fits."""
    given = {k: v for k, v in given.items() if v is not None}
    # A number the user gives is theirs to vouch for: no longer an estimate of ours.
    given["estimated"] = tuple(k for k in base.estimated if k not in given)
    if "peak_tflops" in given:
        given["compute"] = {}
    if given.keys() & {"intra_gbps", "inter_gbps", "latency_us"}:
        given["collectives"] = {}
    return replace(base, **given)


def fmt_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{int(n)} B"
