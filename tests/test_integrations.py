"""NodecommAllreduce driven the way vLLM and SGLang drive their custom all-reduce, on the CPU:
their plugin entry points, construction over a gloo group, capture(), eager calls, teardown."""

import subprocess
import sys

import pytest

import engine_ranks
import ranks
from conftest import free_port

# bfloat16 elements: small decode sizes, one past a slot, and 9 MiB (past the 8 MiB max_size).
COUNTS = [8, 1000, 4100, (5 << 20) // 2, 9 << 19]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "vllm-platform"])
def test_engine_call_sequence(daemon, spawn_ranks, engine):
    """The slot in both engines, and vLLM's communicator from nodecomm's platform (which asks
    nodecomm first and hands the rest to vLLM's order: here its NCCL)."""
    world_size = 2
    results = spawn_ranks(
        engine_ranks.engine_sequence, world_size, world_size, daemon.socket, free_port(), engine, "cpu", COUNTS,
        timeout=240,
    ).values()  # fmt: skip
    for outcome in results.values():
        assert outcome["class"] == "NodecommAllreduce" and not outcome["disabled"]
        assert outcome["native calls"] == ["custom_all_reduce", "should_custom_ar"]
        assert outcome["problems"] == []
        # Everything up to max_size is taken; the 9 MiB call goes to the engine's own all-reduce.
        assert outcome["taken"] == {count: count * 2 <= 8 << 20 for count in COUNTS}
        if engine != "vllm-platform":  # graph_capture() enters the slot's capture(), not the platform's object
            assert outcome["capturing_inside"] and not outcome["capturing_after"]
        assert outcome["released"]
    # Both ranks left their nodecomm group when the engine dropped the object: it was released.
    log = daemon.log()
    assert '"msg": "group released", "group": "engine-ar.' in log and "session ended without Leave" not in log


def test_plugins_change_nothing_unless_asked():
    probe = (
        "import sys, types\n"
        "from nodecomm.integrations import vllm as plugin\n"
        "slot = types.ModuleType(plugin.SLOT_MODULE); slot.CustomAllreduce = object\n"
        "sys.modules[plugin.SLOT_MODULE] = slot\n"
        "plugin.register(); print(slot.CustomAllreduce is object)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "NODECOMM_CUSTOM_ALLREDUCE": "0"}
    printed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert printed.stdout.strip() == "True"


def test_a_slot_one_rank_cannot_join_is_disabled_on_every_rank_without_raising(daemon, spawn_ranks):
    """Rank 1 finds no daemon; rank 0 waits out its 5 s join for it. Neither raises into the
    engine, and both end disabled (ranks answering should_custom_ar differently would hang the
    engine's group), each saying why; the attributes models read are there and truthful."""
    results = spawn_ranks(engine_ranks.construct_slot, 2, 2, daemon.socket, free_port(), timeout=120).values()
    assert [results[rank]["disabled"] and not results[rank]["taken"] for rank in (0, 1)] == [True, True]
    assert "ranks [1] never joined" in results[0]["reason"], results[0]
    assert ".nowhere" in results[1]["reason"], results[1]
    assert all(not r["fully_connected"] and r["multicast"] == 0 for r in results.values())


def test_the_slot_knows_one_node_from_another_by_the_kernels_boot():
    from nodecomm.integrations.engine_group import node_identity, nvlink_between

    assert node_identity() == node_identity() != ""
    assert not nvlink_between(["", ""])  # the CPU, or GPUs this process cannot name


def test_a_batch_invariant_engine_gets_every_size_and_a_rows_bits_never_depend_on_its_batch(daemon, spawn_ranks):
    """VLLM_BATCH_INVARIANT=1: the slot takes batches of 1, 7 and 300 rows of 16384 bfloat16 (the
    last 9.6 MiB, past the 8 MiB it takes otherwise) on nodecomm's lossless paths, and one row
    among them comes back with the same bits each time: the fp32 rank-order sum, rounded once."""
    results = spawn_ranks(
        engine_ranks.batch_invariant_rows, 2, 2, daemon.socket, free_port(), 16384, "cpu", timeout=240
    ).values()
    for outcome in results.values():
        assert outcome == {"taken": {1: True, 7: True, 300: True}, "same": True, "exact": True}, outcome


def test_the_engines_batch_invariant_settings_are_read_as_they_read_them():
    from nodecomm.integrations.custom_all_reduce import deterministic_requested

    assert deterministic_requested({"VLLM_BATCH_INVARIANT": "1"})
    assert not deterministic_requested({"VLLM_BATCH_INVARIANT": "0"}) and not deterministic_requested({})
    assert deterministic_requested({"SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "true"})
    # SGLang's one-stage all-reduce switch, where set, decides over its deterministic-inference one.
    assert not deterministic_requested(
        {"SGLANG_USE_1STAGE_ALLREDUCE": "false", "SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "true"}
    )


def test_the_vllm_platform_answers_only_when_asked_and_its_communicator_is_vllms():
    """vLLM asks every platform plugin; nodecomm's answers None unless NODECOMM_VLLM_PLATFORM is
    set, and its platform is vLLM's CUDA platform naming a communicator that is a CudaCommunicator
    (vLLM's graph_capture() checks that)."""
    probe = (
        "import pkgutil, sys\n"
        f"sys.path.insert(0, {engine_ranks.STANDINS!r})\n"
        "from nodecomm.integrations import vllm as plugin\n"
        "from vllm.platforms.cuda import CudaPlatform\n"
        "from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator\n"
        "name = plugin.platform()\n"
        "platform = pkgutil.resolve_name(name) if name else None\n"
        "communicator = platform and pkgutil.resolve_name(platform.get_device_communicator_cls())\n"
        "print(name, platform is not None and issubclass(platform, CudaPlatform),\n"
        "      communicator is not None and issubclass(communicator, CudaCommunicator))\n"
    )
    for switch, printed in (
        ("0", "None False False"),
        ("1", "nodecomm.integrations.vllm_platform.NodecommCudaPlatform True True"),
    ):
        env = {"PATH": "/usr/bin:/bin", "NODECOMM_VLLM_PLATFORM": switch}
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
        assert result.stdout.strip() == printed, result.stderr


def test_the_vllm_slot_keeps_vllms_static_buffer_helpers():
    """Models call CustomAllreduce.create_shared_buffer on whatever class holds the slot, for
    buffers of their own: the class nodecomm puts there answers with vLLM's own helper."""
    probe = (
        "import sys, importlib\n"
        f"sys.path.insert(0, {engine_ranks.STANDINS!r})\n"
        "from nodecomm.integrations import vllm as plugin, NodecommAllreduce\n"
        "plugin.register(); plugin.register()\n"
        "slot = importlib.import_module(plugin.SLOT_MODULE).CustomAllreduce\n"
        "print(issubclass(slot, NodecommAllreduce), slot.__name__, slot.create_shared_buffer(4096, group=None))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "NODECOMM_CUSTOM_ALLREDUCE": "1"}
    printed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert printed.stdout.strip() == 'True NodecommAllreduce ["vLLM\'s own", 4096]', printed.stderr


@pytest.mark.parametrize("native", [False, True], ids=["communicator", "engine_slot"])
def test_the_slot_call_runs_what_accepts_takes_and_declines_the_rest_untouched(daemon, spawn_ranks, native):
    """Communicator.slot_all_reduce, what the engines' slot calls: one native call that runs the
    table's path (the service path too, where accepts() said yes) and returns None, with nothing
    run, for whatever accepts() declines; every rank the same. The same through engine_slot()'s
    two native calls, which finish in Python what the lane leaves (the service path, a subclass)."""
    results = spawn_ranks(ranks.slot_calls, 2, 2, daemon.socket, native).values()
    assert results[0] == results[1]
    assert results[0]["results"] == {
        "small": [3.0],
        "large (service path)": [3.0],
        "past max_bytes": None,
        "float64": None,
        "strided": None,
        "subclass": [3.0],
        "closed": None,
    }
    assert results[0]["accepts"] == {
        "small": True,
        "past max_bytes": False,
        "at max_bytes": True,
        "float64": False,
        "subclass past max_bytes": False,
        "closed": False,
    }
