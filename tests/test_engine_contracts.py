"""What vLLM and SGLang read on their custom all-reduce object (and vLLM on the class in its slot),
from their released source: every attribute one of them reads without asking first must be on
NodecommAllreduce, so that a new release that reads one more fails here, naming the file and line,
before an engine does; and vLLM's own dispatch function, run from its file, hands the slot what it
accepts."""

import ast
import inspect
import zipfile

import engine_source
import pytest
import torch
import torch.distributed as dist

import engine_ranks
from conftest import free_port
from nodecomm.integrations import NodecommAllreduce, vllm_dcp_topk
from nodecomm.integrations import vllm as vllm_plugin

# Reads that are not of the slot, or that the engine reaches only where an attribute it probes
# first is there; each with why (checked against the pinned source).
NOT_THE_SLOT = {
    ("vllm", "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"): (
        "ROCm AITER's all-reduce (rocm_aiter_ops.get_aiter_allreduce()), held in a variable of that name"
    ),
}
PAST_A_PROBE = {
    ("sglang", "max_push_size"): (
        "vocab_gather.py reads it only where getattr(ca_comm, 'obj', None) is set (_nvlink_ca_comm), which "
        "NodecommAllreduce does not have, so SGLang keeps its NCCL vocab gather"
    ),
    ("sglang", "obj"): "read as getattr(ca_comm, 'obj', None) first (_nvlink_ca_comm), then in NVLinkVocabGather",
    ("sglang", "reduce_scatter"): "parallel_state.py asks hasattr(ca_comm, 'reduce_scatter') first (line 1159)",
    ("sglang", "all_gather_reg"): "parallel_state.py asks hasattr(ca_comm, 'all_gather_reg') first (line 1353)",
    ("sglang", "all_gather_unreg"): "parallel_state.py asks hasattr(ca_comm, 'all_gather_unreg') first (line 1354)",
    ("sglang", "should_custom_ag"): "parallel_state.py asks hasattr(ca_comm, 'should_custom_ag') first (line 1352)",
}
# What each pinned release reads unasked, with one place it does (the test lists them all).
READS = {
    ("vllm", "0.34.0"): {
        "capture": "vllm/distributed/parallel_state.py:705",
        "create_shared_buffer": "vllm/models/minimax_m3/amd/indexer_cp.py:40",
        "custom_all_gather": "vllm/distributed/device_communicators/cuda_communicator.py:479",
        "custom_all_reduce": "vllm/distributed/device_communicators/cuda_communicator.py:440",
        "custom_reduce_scatter": "vllm/distributed/device_communicators/cuda_communicator.py:485",
        "disabled": "vllm/distributed/device_communicators/cuda_communicator.py:373",
        "fully_connected": "vllm/models/deepseek_v41/nvidia/model.py:294",
        "mnnvl_lamport_ag_multicast_ptr": "vllm/models/deepseek_v41/nvidia/ops/mhc.py:73",
        "should_custom_ar": "vllm/distributed/device_communicators/cuda_communicator.py:438",
    },
    ("sglang", "0.5.23"): {
        "capture": "sglang/srt/distributed/parallel_state.py:625",
        "custom_all_reduce": "sglang/srt/distributed/parallel_state.py:1047",
        "disabled": "sglang/srt/distributed/parallel_state.py:751",
        "should_custom_ar": "sglang/srt/distributed/parallel_state.py:752",
    },
}


# The class each engine's slot holds, where the plugin names it: reads on it count too.
SLOT_CLASSES = {"vllm": (vllm_plugin.SLOT_MODULE, "CustomAllreduce")}


@pytest.fixture(scope="module")
def slot_attributes() -> set[str]:
    """What a NodecommAllreduce has: its class's, and those its constructor sets (a group of one
    rank, which returns before joining anything)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        slot = NodecommAllreduce(dist.group.WORLD, "cpu")
        return set(dir(slot))
    finally:
        dist.destroy_process_group()


def attributes_in_slot(engine: str, slot_attributes: set[str]) -> set[str]:
    """What the engine's slot holds: vLLM's class keeps vLLM's own static buffer helpers."""
    return slot_attributes | (set(vllm_plugin.BUFFER_HELPERS) if engine == "vllm" else set())


@pytest.mark.parametrize("engine, version", list(READS))
def test_every_attribute_the_engine_reads_on_the_slot_unasked_is_there(engine, version, slot_attributes):
    reads = engine_source.slot_reads(engine_source.wheel(engine, version), engine, SLOT_CLASSES.get(engine))
    unasked = {}
    for attribute, sites in reads.items():
        sites = [s for s in sites if (engine, s.where.split(":")[0]) not in NOT_THE_SLOT]
        if not all(s.probed for s in sites):
            unasked[attribute] = sorted(s.where for s in sites if not s.probed)
    # Every exception still applies to this release (else it hides nothing and goes).
    excepted = [a for e, a in PAST_A_PROBE if e == engine]
    assert [a for a in excepted if a not in unasked] == [], "PAST_A_PROBE lists reads this release no longer makes"
    unasked = {a: sites for a, sites in unasked.items() if a not in excepted}
    listed = {attribute: READS[(engine, version)].get(attribute) for attribute in unasked}
    assert {a: sites[0] for a, sites in unasked.items() if listed[a] not in sites} == {}, unasked
    assert sorted(unasked) == sorted(READS[(engine, version)]), unasked
    held = attributes_in_slot(engine, slot_attributes)
    missing = {attribute: where for attribute, where in unasked.items() if attribute not in held}
    assert missing == {}, f"{engine} {version} reads these on its custom all-reduce, NodecommAllreduce lacks them"


def dispatched(spawn_ranks, daemon, program, engine: str, version: str, counts: list[int]) -> list[dict]:
    """Each of two ranks' outcome of `program` run with the engine's pinned wheel on `counts`."""
    wheel = str(engine_source.wheel(engine, version))
    ranks = spawn_ranks(program, 2, 2, daemon.socket, free_port(), wheel, counts, timeout=240)
    return list(ranks.values().values())


def test_vllms_own_all_reduce_dispatch_hands_the_slot_what_it_accepts(daemon, spawn_ranks):
    """vLLM 0.34.0's CudaCommunicator.all_reduce, compiled from the released file and run with the
    slot as its custom all-reduce (its other backends off, gloo standing in for PyNccl): the sizes
    the slot accepts reach it and come back as the fp32 rank-order sum's bits; the 9 MiB one,
    past max_size, goes on down vLLM's order."""
    counts = [8, 1000, 4100, 9 << 19]
    results = dispatched(spawn_ranks, daemon, engine_ranks.vllm_dispatch, "vllm", "0.34.0", counts)
    for outcome in results:
        assert outcome == {"served": counts[:3], "problems": []}, outcome


def test_the_vllm_platforms_communicator_goes_first_then_hands_the_rest_to_vllms_order(daemon, spawn_ranks):
    """nodecomm's communicator over vLLM 0.34.0's CudaCommunicator.all_reduce as released, with
    QuickReduce (up to 16 MiB) and FlashInfer (every size) ready: what nodecomm's table accepts
    reaches nodecomm ahead of both, with the fp32 rank-order sum's bits; 9 MiB goes on to
    QuickReduce and 20 MiB to FlashInfer, in vLLM's order. torch.ops.nodecomm.all_reduce_rms_norm
    runs nodecomm's fused call up to the slot's limit (nodecomm.rms_norm's bits) and vLLM's
    all-reduce, then torch's add and RMSNorm, past it."""
    counts = [8, 1000, 4100, 9 << 19, 10 << 20]
    results = dispatched(spawn_ranks, daemon, engine_ranks.vllm_platform_dispatch, "vllm", "0.34.0", counts)
    served = [("nodecomm", c) for c in counts[:3]] + [("quick", counts[3]), ("flashinfer", counts[4])]
    served += [("fused", 1), ("fused", 7), ("quick", 1152 * 4096)]  # torch.ops.nodecomm.all_reduce_rms_norm
    for outcome in results:
        assert outcome == {"served": served, "problems": []}, outcome


def test_sglangs_own_plugin_loader_and_all_reduce_dispatch_hand_the_slot_what_it_accepts(daemon, spawn_ranks):
    """SGLang 0.5.23's load_plugins and HookRegistry, from the wheel, apply nodecomm's REPLACE hook,
    so the slot GroupCoordinator builds is nodecomm's; SGLang's all_reduce, as released, sends the
    sizes it accepts there (the fp32 rank-order sum's bits) and the 9 MiB one, past its limit, to
    the in-place all-reduce on the engine's device group. The fused all-reduce and RMSNorm, asked
    through the wheel's GroupCoordinator.fused_allreduce_rmsnorm and through the FlashInfer
    function nodecomm's AROUND hook wraps, is nodecomm's up to the limit (nodecomm.rms_norm's
    bits) and FlashInfer's past it."""
    counts = [8, 1000, 4100, 9 << 19]
    results = dispatched(spawn_ranks, daemon, engine_ranks.sglang_dispatch, "sglang", "0.5.23", counts)
    for outcome in results:
        norm = {"flashinfer_asked": [1152], "problems": []}  # the rows nodecomm declines go on to FlashInfer's
        assert outcome == {"class": "NodecommAllreduce", "served": counts[:3], "problems": [], "norm": norm}, outcome


# vLLM's DCP top-k merge (nodecomm.integrations.vllm_dcp_topk), read from the pinned release.
INDEXER_FILE = "vllm/model_executor/layers/sparse_attn_indexer.py"
CUTEDSL_FILE = "vllm/model_executor/kernels/attention/dsa/dcp_indexer_cutedsl.py"
DIRECT_FILE = "vllm/model_executor/kernels/attention/dsa/dcp_topk_direct.py"


def _vllm_modules(path) -> dict[str, ast.Module]:
    with zipfile.ZipFile(path) as archive:
        return {
            name: ast.parse(archive.read(name).decode(), name)
            for name in archive.namelist()
            if name.startswith("vllm/") and name.endswith(".py") and b"_merge_dcp_topk_global" in archive.read(name)
        }


def _signature(tree: ast.Module, name: str, class_name: str | None = None) -> list[tuple[str, str | None]]:
    """(parameter, its default as source or None) of a module function or method, `self` left out."""
    body = tree.body
    if class_name is not None:
        (owner,) = [n for n in body if isinstance(n, ast.ClassDef) and n.name == class_name]
        body = owner.body
    (function,) = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    arguments = [a.arg for a in function.args.args if a.arg != "self"]
    defaults = [None] * (len(arguments) - len(function.args.defaults)) + [
        ast.unparse(d) for d in function.args.defaults
    ]
    return list(zip(arguments, defaults, strict=True))


def _ours(function) -> list[tuple[str, str | None]]:
    parameters = [p for p in inspect.signature(function, follow_wrapped=False).parameters.values() if p.name != "self"]
    return [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in parameters]


def _same_parameters(theirs: list[tuple[str, str | None]], ours: list[tuple[str, object]]) -> bool:
    """The same names in the same order, and defaults that evaluate alike."""
    namespace = {"torch": torch}
    return [n for n, _ in theirs] == [n for n, _ in ours] and all(
        (d is None and o is None) or (d is not None and eval(d, namespace) == o)  # noqa: S307 (vLLM's own defaults)
        for (_, d), (_, o) in zip(theirs, ours, strict=True)
    )


def test_the_dcp_merge_plugin_replaces_what_vllm_calls_with_vllms_signature():
    """The merge nodecomm puts in place has vLLM's parameters and defaults; every call of it in
    the release binds to them; every module that imports it by name imports it from the indexer's
    module (install() replaces it there, and in any module that imported it already); the
    constructor the plugin wraps sets what it reads; and the workspace's merge is vLLM's."""
    path = engine_source.wheel("vllm", "0.34.0")
    modules = _vllm_modules(path)
    indexer = modules[vllm_dcp_topk.INDEXER_MODULE.replace(".", "/") + ".py"]
    ours = vllm_dcp_topk.merging(lambda *args, **kwargs: None)
    assert _same_parameters(_signature(indexer, vllm_dcp_topk.MERGE), _ours(ours))
    signature, calls, importers = inspect.signature(ours, follow_wrapped=False), 0, set()
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == vllm_dcp_topk.MERGE:
                calls += 1
                signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})  # TypeError if not
            if isinstance(node, ast.ImportFrom) and any(a.name == vllm_dcp_topk.MERGE for a in node.names):
                assert node.module == vllm_dcp_topk.INDEXER_MODULE, (name, node.module)
                importers.add(name)
    assert calls >= 4 and "vllm/models/glm5next/nvidia/sparse_indexer.py" in importers, (calls, importers)
    (indexer_class,) = [
        n for n in indexer.body if isinstance(n, ast.ClassDef) and n.name == vllm_dcp_topk.INDEXER_CLASS
    ]
    (constructor,) = [n for n in indexer_class.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    assigned = {t.attr for n in ast.walk(constructor) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}  # fmt: skip
    assert {"topk_tokens", "topk_indices_buffer", "dcp_world_size"} <= assigned
    assert any(isinstance(n, ast.ImportFrom) and any(a.name == "get_dcp_group" for a in n.names) for n in indexer.body)
    with zipfile.ZipFile(path) as archive:
        direct = ast.parse(archive.read(DIRECT_FILE).decode(), DIRECT_FILE)
    assert _same_parameters(
        _signature(direct, "merge", "DirectDCPTopKWorkspace"), _ours(vllm_dcp_topk.DcpTopkWorkspace.merge)
    )


def test_the_dcp_merge_keys_scores_and_ids_on_vllms_bits():
    """vLLM's own dcp_topk_score_bits and dcp_topk_id_bits, compiled from the release, give what
    nodecomm's merge is passed."""
    theirs = engine_source.functions(
        engine_source.wheel("vllm", "0.34.0"), CUTEDSL_FILE, ["dcp_topk_score_bits", "dcp_topk_id_bits"],
        {"torch": torch},
    )  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert theirs["dcp_topk_score_bits"](dtype) == vllm_dcp_topk.score_bits(dtype)
    for positions in (1, 2, 3, 1000, 1 << 16, (1 << 16) + 1, 163840, 1 << 31, 1 << 40):
        assert theirs["dcp_topk_id_bits"](positions) == vllm_dcp_topk.id_bits(positions)
