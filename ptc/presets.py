"""Hardware presets: the GPUs (and the CPU) a plan can name by one word.

Figures are the vendors' dense (no sparsity) peaks and per-direction link
bandwidths per GPU. `achievable_fraction` is the share of the dense peak the
matrix products (GEMMs) of a training step reach in full waves: the cost model
prices each GEMM's FLOPs over its shape's tile and wave efficiency on the
GPU's `multiprocessors` (the SM counts of NVIDIA's architecture whitepapers:
A100 108, H100 SXM5 and H200 132, B200 and GB200 148, B300 and GB300 160, V100 80;
`ptc.compiler.graph.gemm_tiles`)
at peak x achievable_fraction, memory-bound ops by the bytes they move at
`mem_bandwidth` and the host's dispatch of each op at `dispatch_overhead`
(`ptc.compiler.cost.compute`). The shares are those a tuned transformer step
reaches in practice, set from published runs by one rule, one parameter per
chip: for each run of `published_runs.csv` (../shared/validation) the share at
which ptc's prediction of that run equals its measurement, all else as priced,
and the preset takes the median over the chip's runs
(`python bench/validate_cost_model.py --solve-shares`): A100 0.62 (31 runs;
both memory sizes, one chip), V100 0.69 (4), H100 0.58 (11; H200, B200, B300,
GB200 and GB300 take Hopper's, scored out of sample by
`bench/validate_out_of_sample.py`). Megatron-LM's own whole-step figures agree
about as well once the rest of the step is priced apart: 52 % of peak on A100 with
recompute counted (Narayanan et al., SC21), 45-50 % model FLOPs on H100 (its
2024 README), 57 % on one V100 (its 2020 README, GPT-2 1.2B). They are well
below what one GEMM reaches alone: Stas Bekman's "Maximum Achievable Matmul
FLOPS" (Machine Learning Engineering, the bf16 MAMF table, `mamf-finder.py`,
the best of a sweep of shapes) measures A100 SXM 271.2 of 312 TFLOP/s (86.9 %),
H100 SXM 794.5 of 989 (80.3 %), B200 1745 of 2250 (77.6 %). Priced at those,
every published run in `bench/validate_cost_model.py` comes out 20-40 % too
fast once its memory-bound ops are priced as the fused kernels it ran
(docs/cost-model.md, "Validation"): a step's GEMMs, among its other kernels,
run at about 0.6 of peak on A100 and 0.55 on H100, not at the
microbenchmark's best. A property of the GPU and its libraries, not of any
one published run.

`dispatch_overhead` is 0 on the GPUs: their kernels run while the host queues
the next ones, and for the models they train the kernels take longer than the
dispatch (`ptc calibrate` measures it where that may not hold). The CPU
preset's figures stand for a small x86 server (its dispatch overhead:
`ptc calibrate` of the tiny example plan on one process of a 2-core x86
machine, 6.4 us per op); `ptc calibrate` measures yours.

`host_bandwidth` is the GPU's own link to host memory, per direction: PCIe
Gen4 x16 on A100 (16 GT/s x 16 lanes, 128b/130b: 31.5 GB/s, NVIDIA's A100
datasheet "PCIe Gen4: 64 GB/s" counts both directions), PCIe Gen5 x16 on
H100 and H200 (63 GB/s; NVIDIA's H100 datasheet "PCIe Gen5: 128 GB/s", both
directions), PCIe Gen6 x16 on B300 (128 GB/s). For the CPU preset the
"device" is host memory itself: its memory bandwidth.

`board_power` is the part's board power (TDP), the power limit its figures
hold at: A100 SXM 400 W (NVIDIA A100 datasheet), H100 SXM and H200 700 W
(NVIDIA H100 and H200 datasheets, "up to 700 W, configurable"; MLPerf
Inference v4.1, NVIDIA's H200-SXM-141GB system: "H200 TGP 700W"), B200
1000 W (MLPerf Inference v6.0, Nebius's B200-SXM-180GB system: "B200 TGP
1000W"), GB200 1200 W per GPU (the rated power facebookexperimental/triton's
benchmark script holds GB200 to, its pull request 2023), GB300 1400 W per GPU
(nvidia-smi's default and maximum limit on GB300, the same pull request), B300
1000 W (no per-GPU figure of NVIDIA's was found: the DGX B300's 14.5 kW system
power against the DGX B200's 14.3 kW puts it within 25 W of B200's), V100
SXM2 300 W (NVIDIA V100 datasheet). `min_power_limit` is the lowest limit
`nvidia-smi -pl` accepts, its "Min Power Limit": A100 SXM4 100 W (`nvidia-smi
-q` of A100-SXM4 parts, NVIDIA/DCGM issue 152 and NVIDIA/nvidia-docker issue
1648), V100-SXM2-32GB 150 W (NVIDIA/nvidia-docker issue 1076), H100 and H200
200 W (`nvidia-smi -q -d power` of a 700 W Hopper part: "between 200.00 W and
700.00 W", stackhpc/ansible-slurm-appliance pull request 975). No Blackwell
figure of its own was found: B200, B300, GB200 and GB300 take the 200 W the DGX
B200 user guide's power-capping example shows ("AllowableMin": 200, beside a
Hopper part's "AllowableMax": 700). How a limit below board power prices a
step: `sustained_clock_share`.

`comm_multiprocessors` is how many SMs a collective's kernels hold while it
runs: NCCL runs a collective as one thread block per channel, each on an SM
of its own, so compute that runs beside a hidden collective has the other SMs
(the cost model charges each hidden second comm_multiprocessors /
multiprocessors of a second of compute, docs/cost-model.md). 24 on every GPU
preset: the blocks an H100's ncclAllGather launched beside an FSDP step's
GEMMs under Nsight Systems (NVIDIA developer forums, "Compute-Communication
Overlap Causes Severe GEMM Performance Degradation because of Tail Effect",
2025: 24 blocks on 132 SMs); NCCL sizes its channels by the node's links, not
the SM count, so the Blackwell and Ampere parts take the same count until a
figure of their own is found.

`host_memory_bytes` is the usual node's: 1 TB (DGX A100), 2 TB (DGX H100,
DGX H200, DGX B200, DGX B300), 1.5 TB (DGX-2), 36 Grace CPUs of 480 GB each
(GB200 and GB300 NVL72 racks); for the CPU preset, the memory of its 8 ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ptc.units import UNITS

GiB = UNITS["GiB"][1]
GB = 10**9
TB = 10**12
GB_S = UNITS["GB/s"][1]
TFLOPS = UNITS["TFLOP/s"][1]
US = UNITS["us"][1]
W = UNITS["W"][1]

PCIE3_X16 = 16 * GB_S
"""PCIe Gen3 x16, per direction (V100 hosts)."""
PCIE4_X16 = 32 * GB_S
"""PCIe Gen4 x16, per direction (31.5 GB/s, rounded): A100's host link."""
PCIE5_X16 = 64 * GB_S
"""PCIe Gen5 x16, per direction (63 GB/s, rounded): H100's and H200's host link."""
PCIE6_X16 = 128 * GB_S
"""PCIe Gen6 x16, per direction (64 GT/s x 16 lanes, before FLIT overhead): B300's host link."""

NCCL_BLOCKS = 24
"""SMs a running NCCL collective holds on a GPU preset (`comm_multiprocessors`, module
docstring)."""

NVLINK_C2C_PER_GPU = 225 * GB_S
"""NVLink-C2C, per GPU and direction: a Grace CPU's 900 GB/s (both directions) shared by the
two Blackwell GPUs of a GB200 / GB300 superchip."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPreset:
    """Published figures of one accelerator and its usual node."""

    name: str
    """Preset name as written in plans, e.g. "H100-SXM"."""
    hbm_bytes: float
    """Device memory in bytes."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per compute dtype ("fp32", "tf32", "bf16", "fp16", "fp8")."""
    mem_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_bandwidth: float
    """Per-GPU, per-direction bandwidth inside a node (NVLink), bytes/s."""
    intra_latency: float
    """Latency of one intra-node transfer, seconds."""
    inter_bandwidth: float
    """Per-GPU, per-direction bandwidth across nodes (InfiniBand), bytes/s."""
    inter_latency: float
    """Latency of one inter-node transfer, seconds."""
    gpus_per_node: int
    """GPUs in the usual node (DGX/HGX)."""
    nvlink_sharp: bool
    """Whether the NVSwitch does in-network reductions (NVLS)."""
    achievable_fraction: float
    """Share of the dense peak a training step's matrix products reach (see module
    docstring)."""
    host_bandwidth: float
    """Per-GPU, per-direction bandwidth to host memory (PCIe), bytes/s."""
    host_memory_bytes: float
    """Host memory of the usual node, bytes (what its in-memory snapshots may use)."""
    dispatch_overhead: float = 0.0
    """Host seconds to dispatch one op (see module docstring)."""
    multiprocessors: int = 0
    """Streaming multiprocessors: the GEMM tile model's wave (`ptc.compiler.graph.gemm_tiles`);
    0 for the CPU, whose GEMMs are priced by FLOPs alone."""
    board_power: float = 0.0
    """Board power (TDP), watts: the power limit the figures above hold at; 0 for the CPU,
    which has no limit to cap (module docstring)."""
    min_power_limit: float = 0.0
    """The lowest power limit the part accepts (nvidia-smi's "Min Power Limit"), watts."""

    @property
    def comm_multiprocessors(self) -> int:
        """SMs a running collective's kernels hold (module docstring): NCCL's blocks on a
        GPU; 0 on the CPU, where nothing runs beside compute."""
        return NCCL_BLOCKS if self.multiprocessors else 0


CLOCK_POWER_EXPONENT = 1 / 3
"""The exponent of `sustained_clock_share`: dynamic power grows as the cube of the clock."""


def sustained_clock_share(power_limit: float, board_power: float) -> float:
    """The share of its full-power clock a GPU sustains in matrix products when held to
    `power_limit` watts instead of its `board_power`: (power_limit / board_power)^(1/3),
    1 at or above board power. Matrix products run at the clock, so their FLOP/s scale by
    it; memory-bound ops and links do not.

    Model: a CMOS chip's dynamic power is a·C·V²·f (switched capacitance C, activity a,
    voltage V, clock f; Hennessy and Patterson, "Computer Architecture: A Quantitative
    Approach", 6th ed., section 1.5, "Trends in Power and Energy in Integrated
    Circuits"), and across the range where a GPU's DVFS lowers the voltage with the
    clock, V ∝ f, so P ∝ f³. A step's matrix products keep the SMs busy and hold a
    full-power part at its board power, so under a cap the clock settles where power
    meets the cap: f_cap / f_full = (P_cap / P_board)^(1/3). Static (leakage) power is
    left out, which makes this the least a cap costs; below the voltage floor, far under
    board power, clock and power fall in proportion and a cap costs more than this
    (docs/cost-model.md, "Power limits"). The power limit lowers the SM clock, not the
    HBM's: memory-bound kernels draw far less than a cap (Ma et al., "The Illusion of
    Power Capping in LLM Decode", arXiv 2605.11999: memory-bound decode draws 137-300 W on
    a 700 W H200 and no cap triggers), so their bandwidth stays.

    A check, not a fit: NVIDIA's A100 PCIe is the SXM part's GA100 at 250 W instead of
    400 W, same clocks, and NVIDIA rates it at 90 % of the SXM's performance in real
    applications (its June 2020 launch figures, as Hardware Times reported them). The
    model gives (250/400)^(1/3) = 0.855 on matrix products; with a third of an
    application's time memory-bound and unslowed, 0.90 overall."""
    if power_limit >= board_power:
        return 1.0
    return (power_limit / board_power) ** CLOCK_POWER_EXPONENT


# NVIDIA GB200 NVL72 specifications (rack of 72 Blackwell GPUs; per GPU = rack total
# / 72, tensor figures with sparsity halved): FP8 720 PFLOP/s -> 5 dense, FP16 = BF16
# 360 -> 2.5, TF32 180 -> 1.25 PFLOP/s, FP32 5,760 TFLOP/s -> 80; up to 13.4 TB
# HBM3e (186 GB per GPU) at 576 TB/s (8 TB/s per GPU); NVLink 5: 130 TB/s (1.8 TB/s
# per GPU, both directions), all 72 GPUs on one NVLink Switch domain (the "node");
# one 400 Gb/s ConnectX-7 per GPU across racks; NVLink-C2C to the Grace CPU: 900 GB/s
# (both directions) shared by its two GPUs. Same GPU as B200 (148 SMs, its share).
GB200 = GpuPreset(name="GB200", hbm_bytes=186 * 10**9,
                  peak_flops={"fp32": 80 * TFLOPS, "tf32": 1250 * TFLOPS,
                              "bf16": 2500 * TFLOPS, "fp16": 2500 * TFLOPS,
                              "fp8": 5000 * TFLOPS},
                  mem_bandwidth=8000 * GB_S, intra_bandwidth=900 * GB_S, intra_latency=2 * US,
                  inter_bandwidth=50 * GB_S, inter_latency=5 * US, gpus_per_node=72,
                  nvlink_sharp=True, achievable_fraction=0.58,
                  host_bandwidth=NVLINK_C2C_PER_GPU, multiprocessors=148,
                  host_memory_bytes=36 * 480 * GB, board_power=1200 * W,
                  min_power_limit=200 * W)
"""NVIDIA GB200: the Blackwell GPU of an NVL72 rack (GB300 is this with its own memory, NIC
and SMs)."""

# NVIDIA GB300 NVL72 specifications (Blackwell Ultra; per GPU = rack total / 72): FP8 360
# PFLOP/s dense -> 5, FP16 = BF16 180 -> 2.5 PFLOP/s, as GB200; 288 GB HBM3e per GPU (up to
# 20 TB per rack) at 576 TB/s (8 TB/s per GPU); NVLink 5 and NVLink-C2C as GB200; one 800
# Gb/s ConnectX-8 per GPU. 160 SMs (NVIDIA's "Inside NVIDIA Blackwell Ultra" technical
# blog); the share is Hopper's, as for B200.
GB300 = dataclasses.replace(GB200, name="GB300", hbm_bytes=288 * 10**9,
                            inter_bandwidth=100 * GB_S, multiprocessors=160,
                            board_power=1400 * W)
"""NVIDIA GB300: the Blackwell Ultra GPU of an NVL72 rack (B300 is this on an 8-GPU board)."""


PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        # NVIDIA A100 Tensor Core GPU datasheet (SXM columns; tensor figures without
        # sparsity): FP32 19.5, TF32 156, BF16 = FP16 312 TFLOP/s; 40 GB HBM2 at 1,555 GB/s,
        # 80 GB HBM2e at 2,039 GB/s; NVLink 3: 600 GB/s per GPU, both directions. Node: DGX
        # A100, 8 GPUs on NVSwitch, 8 x 200 Gb/s HDR InfiniBand.
        GpuPreset(name="A100-40GB", hbm_bytes=40 * GiB,
                  peak_flops={"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                              "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
                  mem_bandwidth=1555 * GB_S, intra_bandwidth=300 * GB_S, intra_latency=3 * US,
                  inter_bandwidth=25 * GB_S, inter_latency=6 * US, gpus_per_node=8,
                  nvlink_sharp=False, achievable_fraction=0.62,
                  host_bandwidth=PCIE4_X16, multiprocessors=108,
                  host_memory_bytes=1 * TB, board_power=400 * W, min_power_limit=100 * W),
        GpuPreset(name="A100-80GB", hbm_bytes=80 * GiB,
                  peak_flops={"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                              "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
                  mem_bandwidth=2039 * GB_S, intra_bandwidth=300 * GB_S, intra_latency=3 * US,
                  inter_bandwidth=25 * GB_S, inter_latency=6 * US, gpus_per_node=8,
                  nvlink_sharp=False, achievable_fraction=0.62,
                  host_bandwidth=PCIE4_X16, multiprocessors=108,
                  host_memory_bytes=1 * TB, board_power=400 * W, min_power_limit=100 * W),
        # NVIDIA H100 Tensor Core GPU datasheet (SXM column, sparsity figures halved):
        # 80 GB HBM3 at 3.35 TB/s, FP32 67, TF32 989/2, BF16 = FP16 1979/2, FP8 3958/2
        # TFLOP/s; NVLink 4: 900 GB/s per GPU, both directions. Node: DGX H100, 8 GPUs on
        # NVSwitch (NVLS), 8 x 400 Gb/s NDR.
        GpuPreset(name="H100-SXM", hbm_bytes=80 * GiB,
                  peak_flops={"fp32": 67 * TFLOPS, "tf32": 494.5 * TFLOPS,
                              "bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS,
                              "fp8": 1979 * TFLOPS},
                  mem_bandwidth=3350 * GB_S, intra_bandwidth=450 * GB_S, intra_latency=2 * US,
                  inter_bandwidth=50 * GB_S, inter_latency=5 * US, gpus_per_node=8,
                  nvlink_sharp=True, achievable_fraction=0.58,
                  host_bandwidth=PCIE5_X16, multiprocessors=132,
                  host_memory_bytes=2 * TB, board_power=700 * W, min_power_limit=200 * W),
        # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column; tensor figures there are
        # with sparsity, halved here): 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (both
        # directions), FP32 67, TF32 989/2, BF16 = FP16 1979/2, FP8 3958/2 TFLOP/s. Node:
        # HGX H200, 8 GPUs on NVSwitch (NVLS), one 400 Gb/s NDR NIC per GPU.
        GpuPreset(name="H200", hbm_bytes=141 * 10**9,
                  peak_flops={"fp32": 67 * TFLOPS, "tf32": 494.5 * TFLOPS,
                              "bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS,
                              "fp8": 1979 * TFLOPS},
                  mem_bandwidth=4800 * GB_S, intra_bandwidth=450 * GB_S, intra_latency=2 * US,
                  inter_bandwidth=50 * GB_S, inter_latency=5 * US, gpus_per_node=8,
                  nvlink_sharp=True, achievable_fraction=0.58,
                  host_bandwidth=PCIE5_X16, multiprocessors=132,
                  host_memory_bytes=2 * TB, board_power=700 * W, min_power_limit=200 * W),
        # NVIDIA DGX B200 / HGX B200 datasheets (8 GPUs; per GPU = total / 8, tensor figures
        # with sparsity halved): 1,440 GB HBM3e (180 GB per GPU) at 64 TB/s (8 TB/s per GPU);
        # FP8 72 PFLOP/s -> 4.5 dense, FP16 = BF16 36 -> 2.25, TF32 18 -> 1.125 PFLOP/s,
        # FP32 600 TFLOP/s -> 75; NVLink 5: 1.8 TB/s per GPU (both directions); networking
        # 8 x ConnectX-7 400 Gb/s (one per GPU). achievable_fraction as Hopper's: no
        # published B200 run is in validation/ to set it by.
        GpuPreset(name="B200", hbm_bytes=180 * 10**9,
                  peak_flops={"fp32": 75 * TFLOPS, "tf32": 1125 * TFLOPS,
                              "bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS,
                              "fp8": 4500 * TFLOPS},
                  mem_bandwidth=8000 * GB_S, intra_bandwidth=900 * GB_S, intra_latency=2 * US,
                  inter_bandwidth=50 * GB_S, inter_latency=5 * US, gpus_per_node=8,
                  nvlink_sharp=True, achievable_fraction=0.58,
                  host_bandwidth=PCIE5_X16, multiprocessors=148,
                  host_memory_bytes=2 * TB, board_power=1000 * W, min_power_limit=200 * W),
        GB200,
        GB300,
        # NVIDIA HGX B300 (8 Blackwell Ultra GPUs; per GPU = total / 8, tensor figures with
        # sparsity halved): FP8 72 PFLOP/s -> 4.5 dense, FP16 = BF16 36 -> 2.25, TF32 18 ->
        # 1.125 PFLOP/s, FP32 600 TFLOP/s -> 75, as HGX B200; 2.3 TB HBM3e (288 GB per GPU)
        # at 8 TB/s per GPU; NVLink 5 at 1.8 TB/s per GPU (both directions); 1.6 TB/s of
        # networking, one 800 Gb/s ConnectX-8 per GPU. 160 SMs, as GB300. Board power: no
        # per-GPU figure of NVIDIA's was found; the DGX B300's 14.5 kW system power against
        # the DGX B200's 14.3 kW (1,000 W GPUs) leaves it within 25 W of B200's: 1,000 W.
        dataclasses.replace(GB300, name="B300", gpus_per_node=8,
                            host_bandwidth=PCIE6_X16, host_memory_bytes=2 * TB,
                            peak_flops={"fp32": 75 * TFLOPS, "tf32": 1125 * TFLOPS,
                                        "bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS,
                                        "fp8": 4500 * TFLOPS},
                            board_power=1000 * W),
        # NVIDIA Tesla V100 datasheet (SXM2 column): 32 GB HBM2 at 900 GB/s, FP32 15.7,
        # tensor (FP16 in, FP32 accumulate) 125 TFLOP/s; no bf16, tf32 or fp8 (Volta).
        # NVLink 2: 300 GB/s per GPU, both directions. Node: DGX-2 / HGX-2, 16 GPUs on
        # NVSwitch (the all-to-all node the cost model's one intra link describes; DGX-1's
        # hybrid cube mesh is not) with 8 x 100 Gb/s EDR InfiniBand per node.
        # achievable_fraction from Megatron-LM's four 2020 V100 runs (module docstring).
        GpuPreset(name="V100-SXM2-32GB", hbm_bytes=32 * GiB,
                  peak_flops={"fp32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS},
                  mem_bandwidth=900 * GB_S, intra_bandwidth=150 * GB_S, intra_latency=3 * US,
                  inter_bandwidth=8 * 12.5 * GB_S / 16, inter_latency=6 * US,
                  gpus_per_node=16, nvlink_sharp=False, achievable_fraction=0.69,
                  host_bandwidth=PCIE3_X16, multiprocessors=80,
                  host_memory_bytes=1.5 * TB, board_power=300 * W, min_power_limit=150 * W),
        GpuPreset(name="cpu", hbm_bytes=16 * GiB,
                  peak_flops={"fp32": 0.2 * TFLOPS, "bf16": 0.1 * TFLOPS},
                  mem_bandwidth=20 * GB_S, intra_bandwidth=5 * GB_S, intra_latency=20 * US,
                  inter_bandwidth=1 * GB_S, inter_latency=50 * US, gpus_per_node=8,
                  nvlink_sharp=False, achievable_fraction=0.3,
                  host_bandwidth=20 * GB_S, dispatch_overhead=6.4 * US,
                  host_memory_bytes=8 * 16 * GiB),
    )
}
"""Preset name -> figures. Names are matched exactly (case-sensitive)."""
