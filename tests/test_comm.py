"""``jax_nvfp4.comm``: the one reader of compiled HLO, against hand-written HLO text."""

import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import comm

# A program shaped like a compiled training step: an entry computation with a packed gather
# and a loss sum, a scan over 6 layers whose body gathers a layer (scope weight_gather) and
# calls a nested loop of 3 micro-steps reducing a gradient (scope grad_reduce, inside a
# transposed scope and under the step's optimizer scope: the innermost library scope decides),
# and a conditional branch. Stack frame tables as XLA prints them (parent ids one above).
STEP = """HloModule jit_step, entry_computation_layout={()->()}

FileNames
1 "/src/train/step.py"
2 "/src/jax_nvfp4/collectives.py"
3 "/src/train/model.py"

FunctionNames
1 "make_step.<locals>.step"
2 "ordered_mean"
3 "Block.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=20 end_line=20 column=1 end_column=2}
3 {file_name_id=3 function_name_id=3 line=30 end_line=30 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], bf16[64])) -> (s32[], bf16[64]) {
  %a2a = u16[4,16]{1,0} all-to-all(%g), channel_id=5, replica_groups=[1,4]<=[4], dimensions={0}, metadata={op_name="jit(step)/optimizer/transpose(jvp(grad_reduce))/all_to_all"}
}

%inner_cond (p: (s32[], bf16[64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%layer_body (p: (s32[], u8[4,64])) -> (s32[], u8[4,64]) {
  %ags = ((u8[1,2,16,8]{3,2,1,0}, u8[1,2]{1,0}), (u8[1,8,16,8]{3,2,1,0}, u8[1,8]{1,0})) all-gather-start(%codes, %scales), channel_id=2, replica_groups=[1,4]<=[4], dimensions={1}, metadata={op_name="jit(step)/while/body/weight_gather/all_gather"}
  %agd = (u8[1,8,16,8]{3,2,1,0}, u8[1,8]{1,0}) all-gather-done(%ags)
  %ar = f32[8]{0} all-reduce(%x), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add, metadata={op_name="jit(step)/while/body/psum" stack_frame_id=3}
  %inner = (s32[], bf16[64]) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}

%layer_cond (p: (s32[], u8[4,64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%branch (p: f32[2]) -> f32[2] {
  ROOT %cp = f32[2]{0} collective-permute(%p), channel_id=6, source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (a: u8[4,64]) -> f32[] {
  %ag = bf16[16,16]{1,0} all-gather(%e), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, metadata={op_name="jit(step)/weight_gather/all_gather"}
  %loss = f32[4]{0} all-gather(%l), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}, metadata={op_name="jit(step)/loss_metrics/all_gather" stack_frame_id=2}
  %w = (s32[], u8[4,64]) while(%t0), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"6"}}
  %c = f32[2] conditional(%i, %x), branch_computations={%branch}
}
"""


class _Mesh:  # what parse reads of a jax Mesh
    axis_names = ("data", "tensor")
    devices = np.arange(4).reshape(2, 2)


def test_bytes_per_instruction_and_async_pairs():
    hlo = """
  %ag = u8[256,64]{1,0} all-gather(%p), channel_id=1, dimensions={0}
  %ags = (u8[32,64]{1,0}, u8[256,64]{1,0}) all-gather-start(%p2), channel_id=2
  %agd = u8[256,64]{1,0} all-gather-done(%ags)
  %ar = (f32[], f32[128,256]{1,0}) all-reduce(%a, %b), channel_id=3, to_apply=%add
  %rs = bf16[16,128]{1,0} reduce-scatter(%g), channel_id=4, dimensions={0}
  %cp = f32[13,72]{1,0} collective-permute(%x), source_target_pairs={{0,1}}
"""
    counts = nv.comm.collective_bytes(hlo)
    assert counts == {
        ("all-gather", "u8"): 2 * 256 * 64,  # the -start counts its output once, -done not at all
        ("all-reduce", "f32"): 4 + 128 * 256 * 4,
        ("reduce-scatter", "bf16"): 16 * 128 * 2,
        ("collective-permute", "f32"): 13 * 72 * 4,
    }
    assert nv.comm.total_bytes(counts, "all-gather") == 2 * 256 * 64


def test_trip_counts_multiply_through_nested_loops_and_branches():
    p = comm.parse(STEP)
    assert p.entry == "main" and p.warnings == ()
    assert p.multipliers["layer_body"] == 6 and p.multipliers["inner_body"] == 18
    assert p.multipliers["branch"] == 1 and p.multipliers["layer_cond"] == 1
    times = {c.instruction: c.times for c in p.collectives}
    assert times == {"ags": 6, "ar": 6, "a2a": 18, "cp": 1, "ag": 1, "loss": 1}
    assert p.by("op", "dtype") == {
        ("all-gather", "bf16"): 16 * 16 * 2,
        ("all-gather", "f32"): 16,
        ("all-gather", "u8"): 6 * (8 * 16 * 8 + 8),
        ("all-reduce", "f32"): 6 * 32,
        ("all-to-all", "u16"): 18 * 4 * 16 * 2,
        ("collective-permute", "f32"): 8,
    }


def test_unknown_trip_count_warns_and_counts_once():
    hlo = STEP.replace('backend_config={"known_trip_count":{"n":"6"}}', "")
    p = comm.parse(hlo)
    assert p.multipliers["layer_body"] == 1 and p.multipliers["inner_body"] == 3
    assert len(p.warnings) == 1 and "main" in p.warnings[0]


def test_stack_tables_follow_real_callers():
    # XLA prints parent ids one above the frame they name: frame 3 (Block.__call__) is called
    # from frame 1 (the step), frame 1 is a root.
    assert comm.stacks(STEP) == {
        1: [("/src/train/step.py", "make_step.<locals>.step")],
        2: [("/src/jax_nvfp4/collectives.py", "ordered_mean"), ("/src/train/step.py", "make_step.<locals>.step")],
        3: [("/src/train/model.py", "Block.__call__"), ("/src/train/step.py", "make_step.<locals>.step")],
    }
    # Tables that name true parents (a root has parent 0) are read as they are.
    true_parents = STEP.replace("1 {file_location_id=1 parent_frame_id=1}", "1 {file_location_id=1}")
    true_parents = true_parents.replace("parent_frame_id=2}", "parent_frame_id=1}")
    assert comm.stacks(true_parents)[3] == [("/src/train/model.py", "Block.__call__"),
                                            ("/src/train/step.py", "make_step.<locals>.step")]


def test_purposes_from_scopes_and_mesh():
    purposes = {c.instruction: c.purpose for c in comm.parse(STEP).collectives}
    assert purposes == {
        "ag": "weight gather", "ags": "weight gather",  # the gather scope decides
        "a2a": "grad reduce",  # the innermost library scope, not the optimizer around it
        "loss": "loss / metrics",
        "ar": "other",  # no library scope: XLA's own (its stack frame says nothing)
        "cp": "other",
    }
    # A scope's name inside another word is not that scope.
    assert comm.purpose("jit(step)/my_weight_gathering/all_gather") == "other"
    with_mesh = comm.parse(STEP, _Mesh())
    rows = {c.instruction: c for c in with_mesh.collectives}
    # {{0,1},{2,3}} on a (data 2, tensor 2) mesh spans the tensor axis: not a gradient sum.
    assert rows["ar"].axes == ("tensor",) and rows["ar"].purpose == "other"
    assert rows["ag"].axes == ("data", "tensor")
    # The same sum over the data axis is XLA's own gradient reduction.
    over_data = comm.parse(STEP.replace("replica_groups={{0,1},{2,3}}", "replica_groups={{0,2},{1,3}}"), _Mesh())
    assert {c.instruction: c for c in over_data.collectives}["ar"].purpose == "grad reduce"
    assert set(comm.PURPOSES) >= set(purposes.values())


def test_replica_group_formats():
    assert comm.replica_groups("x = u8[4] all-gather(y), replica_groups=mesh['a'=4,'b'=2] {'a'}, "
                               "dimensions={0}") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert comm.replica_groups("x = f32[4] all-reduce(y), replica_groups=[2,4]<=[4,2]T(1,0), "
                               "to_apply=%add") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert comm.replica_groups("x = f32[4] all-reduce(y), replica_groups={{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert comm.replica_groups("x = f32[4] all-reduce(y), replica_groups={}, to_apply=%a") == ()
    assert comm.replica_groups("x = f32[4] collective-permute(y), source_target_pairs={{0,1},{1,2}}") == \
        ((0, 1), (1, 2))


def test_weight_gathers_split_packed_and_plain():
    g = comm.parse(STEP).weight_gathers()
    packed = 6 * (8 * 16 * 8 + 8)  # codes [8 tiles, 16, 8] + 8 scale bytes, 6 layers
    assert g == {
        "all_gather_bytes": packed + 512,
        "nvfp4_gather_bytes": packed,
        # 4 bf16 bytes per code byte (two values of 2 bytes each); the bf16 leaf as it is.
        "nvfp4_bf16_gather_bytes": 6 * 4 * 8 * 16 * 8,
        "bf16_gather_bytes": 6 * 4 * 8 * 16 * 8 + 512,
        "other_gather_bytes": 16,
    }
    by = comm.parse(STEP).by_purpose()
    assert by["grad reduce"] == {"all-to-all:u16": 18 * 128}
    assert by["weight gather"] == {"all-gather:bf16": 512, "all-gather:u8": packed}


def test_no_entry_text_is_one_computation():
    p = comm.parse("  %ar = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add")
    assert [(c.op, c.times, c.per_call) for c in p.collectives] == [("all-reduce", 1, 32)]


@pytest.mark.parametrize("line", ["%x = f32[8]{0} add(%a, %b)", "%d = u8[4]{0} all-gather-done(%s)"])
def test_non_collectives_are_not_counted(line):
    assert comm.parse(line).collectives == ()
