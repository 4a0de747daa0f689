"""jax_nvfp4.mesh and the training stack's use of it (train.mesh): (data, tensor) and (rack, data,
tensor) meshes, GB200 NVL72 layouts, multi-process launch.

In-process tests use the 8 simulated CPU devices from conftest.py; the two-rack (144-device)
layout and the multi-process launch run in subprocesses, since a process's device count is
fixed when its backend starts.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_nvfp4.mesh import RACK_AXES, MeshError, axis_sizes, describe, device_domains, device_grid, make_mesh
from train.config import ConfigError, MeshConfig
from train.mesh import build_mesh

from conftest import ROOT, xla_flags


def _ids(mesh_or_grid) -> np.ndarray:
    grid = getattr(mesh_or_grid, "devices", mesh_or_grid)
    return np.vectorize(lambda d: d.id, otypes=[int])(grid)


def _check_hybrid(ids: np.ndarray, domain: int) -> None:
    """Tensor groups inside one domain; data runs across domains first, then within (a
    ``[rack, data, tensor]`` grid: rack r is domain r)."""
    if ids.ndim == 3:
        np.testing.assert_array_equal(ids // domain, np.arange(ids.shape[0])[:, None, None] + 0 * ids)
        ids = ids.reshape(-1, ids.shape[-1])
    dom = ids // domain
    assert (dom == dom[:, :1]).all(), "a tensor group crosses NVLink domains"
    n_dom = len(np.unique(dom))
    per = ids.shape[0] // n_dom
    # Data index i is on domain i // per: consecutive data indices share a domain.
    np.testing.assert_array_equal(dom[:, 0], np.repeat(np.arange(n_dom), per))


def test_default_mesh_is_auto_and_constrainable():
    assert jax.device_count() == 8
    mesh = build_mesh(MeshConfig())
    assert dict(mesh.shape) == {"data": 8, "tensor": 1}
    assert mesh.axis_names == ("data", "tensor")
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    sharding = NamedSharding(mesh, P("data", "tensor"))

    # The trap: with Explicit axes, with_sharding_constraint refuses the mesh.
    @jax.jit
    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, sharding)

    y = f(jnp.ones((8, 4)))
    assert y.sharding.is_equivalent_to(sharding, 2)
    assert float(y.sum()) == 64.0


def test_gb200_layout_in_process():
    # 8 simulated devices as two "racks" of 4: ids 0-3 and 4-7.
    cfg = MeshConfig(tensor=2, layout="gb200", nvl_domain=4)
    mesh = build_mesh(cfg)
    assert dict(mesh.shape) == {"rack": 2, "data": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    ids = _ids(mesh)
    _check_hybrid(ids, 4)
    np.testing.assert_array_equal(ids, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert describe(mesh, 4) == (
        "mesh rack=2 x data=2 x tensor=2 on 8 cpu devices, 2 NVLink domain(s) of 4; "
        "rack: spans 2 domains; data: within one domain; tensor: within one domain")
    # auto picks the same device order, as one data axis, once devices span several domains ...
    np.testing.assert_array_equal(_ids(build_mesh(dataclasses.replace(cfg, layout="auto"))), ids.reshape(4, 2))
    # mesh.racks, when given, must be what the devices span (the SLURM script sets it).
    assert dict(build_mesh(dataclasses.replace(cfg, racks=2)).shape)["rack"] == 2
    with pytest.raises(ConfigError, match=r"mesh.racks=3: the 8 devices fall into 2 NVLink domain"):
        build_mesh(dataclasses.replace(cfg, racks=3))
    # ... and a plain one inside a single domain.
    plain = build_mesh(MeshConfig(tensor=2))
    assert "1 NVLink domain(s) of 8; data: within one domain" in describe(plain)
    # An explicit device subset (here reversed) is honoured.
    sub = build_mesh(MeshConfig(tensor=2, layout="gb200", nvl_domain=2),
                     devices=jax.devices()[:4][::-1])
    _check_hybrid(_ids(sub), 2)


@pytest.mark.parametrize("cfg, n, expect", [
    (MeshConfig(tensor=8, layout="gb200", nvl_domain=4), 8, "mesh.tensor=8: must divide "
                                                            "mesh.nvl_domain=4"),
    (MeshConfig(tensor=2, layout="gb200", nvl_domain=3), 6, "mesh.tensor=2: must divide"),
    (MeshConfig(tensor=2, layout="gb200", nvl_domain=4), 6, "6 devices span several domains but are not a whole"),
    (MeshConfig(tensor=3), 8, "mesh.tensor=3: does not divide the 8 devices"),
])
def test_mesh_errors(cfg, n, expect):
    with pytest.raises(ConfigError) as info:
        build_mesh(cfg, devices=jax.devices()[:n])
    assert expect in str(info.value)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What the layout code reads from a device; real GPUs are not needed to check placement."""

    id: int
    process_index: int
    slice_index: int | None = None
    platform: str = "gpu"
    device_kind: str = "fake GB200"


def test_domains_from_slice_index_use_hybrid_mesh():
    # 2 slices x 8 GPUs, listed interleaved so that only grouping by slice_index is right.
    devs = [FakeDevice(id=i, process_index=i // 4, slice_index=(i // 4) % 2) for i in range(16)]
    assert device_domains(devs, 8) == [d.slice_index for d in devs]
    grid = device_grid(tensor=4, racks=-1, nvl_domain=8, devices=devs)
    assert grid.shape == (2, 2, 4)
    sl = np.vectorize(lambda d: d.slice_index)(grid.reshape(4, 4))
    assert (sl == sl[:, :1]).all()
    np.testing.assert_array_equal(sl[:, 0], [0, 0, 1, 1])


def test_domains_from_process_index():
    # 8 processes x 2 GPUs with the gapped ids of multi-process runtimes; domain = 4 GPUs.
    devs = [FakeDevice(id=p * 1024 + j, process_index=p) for p in range(8) for j in range(2)]
    assert device_domains(devs, 4) == [p // 2 for p in range(8) for _ in range(2)]
    grid = device_grid(tensor=2, racks=-1, nvl_domain=4, devices=devs)
    assert grid.shape == (4, 2, 2)
    procs = np.vectorize(lambda d: d.process_index)(grid.reshape(8, 2))
    np.testing.assert_array_equal(procs, np.repeat(np.arange(8), 2).reshape(8, 2))
    dom = procs // 2
    assert (dom == dom[:, :1]).all()
    # A slice_index every device shares, over more devices than a domain, tells nothing.
    same = [dataclasses.replace(d, slice_index=0) for d in devs]
    assert device_domains(same, 4) == device_domains(devs, 4)
    with pytest.raises(MeshError, match="^nvl_domain=3: not a multiple of the 2 devices"):
        device_domains(devs, 3)
    # The run's mesh says it with the config key.
    with pytest.raises(ConfigError, match="^mesh.nvl_domain=3: not a multiple of the 2 devices per process, cannot "
                                          "place processes in domains$"):
        build_mesh(MeshConfig(nvl_domain=3), devs)
    # One process, no slice_index: simulated devices, domain = id // nvl_domain.
    single = [FakeDevice(id=i, process_index=0, platform="cpu") for i in range(8)]
    assert device_domains(single, 4) == [0] * 4 + [1] * 4


def test_library_gb200_mesh_without_a_config():
    # Two racks of 4 simulated devices (ids 0-3, 4-7), no train config anywhere.
    mesh = make_mesh(tensor=2, racks=2, nvl_domain=4)
    assert mesh.axis_names == RACK_AXES and mesh.axis_types == (AxisType.Auto,) * 3
    assert dict(mesh.shape) == {"rack": 2, "data": 2, "tensor": 2}
    np.testing.assert_array_equal(_ids(mesh), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert describe(mesh, 4) == (
        "mesh rack=2 x data=2 x tensor=2 on 8 cpu devices, 2 NVLink domain(s) of 4; "
        "rack: spans 2 domains; data: within one domain; tensor: within one domain")
    # racks=-1 takes the racks the devices span; the training stack's mesh is this one.
    np.testing.assert_array_equal(_ids(make_mesh(data=4, tensor=2, racks=-1, nvl_domain=4)), _ids(mesh))
    np.testing.assert_array_equal(_ids(build_mesh(MeshConfig(tensor=2, layout="gb200", nvl_domain=4))), _ids(mesh))
    # No rack axis: the same order as one data axis.
    flat = make_mesh(tensor=2, nvl_domain=4)
    assert flat.axis_names == ("data", "tensor")
    np.testing.assert_array_equal(_ids(flat), _ids(mesh).reshape(4, 2))

    # 2 racks x 4 trays x 2 GPUs, domains from process_index, devices listed racks interleaved.
    devs = [FakeDevice(id=p * 1024 + j, process_index=p) for p in (0, 4, 1, 5, 2, 6, 3, 7) for j in range(2)]
    assert device_domains(devs, 8) == [p // 4 for p in (0, 4, 1, 5, 2, 6, 3, 7) for _ in range(2)]
    grid = device_grid(data=8, tensor=2, racks=2, nvl_domain=8, devices=devs)
    procs = np.vectorize(lambda d: d.process_index)(grid)
    np.testing.assert_array_equal(procs, np.repeat(np.arange(8), 2).reshape(2, 4, 2))
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id % 1024)(grid), np.tile([0, 1], (2, 4, 1)))


@pytest.mark.parametrize("kwargs, n, named", [
    (dict(tensor=3), 8, "tensor=3"),
    (dict(data=2, tensor=2), 8, "data=2 x tensor=2 = 4"),
    (dict(tensor=8, racks=-1, nvl_domain=4), 8, "tensor=8"),
    (dict(tensor=2, racks=-1, nvl_domain=4), 6, "nvl_domain=4"),
    (dict(tensor=2, racks=3, nvl_domain=4), 8, "racks=3"),
    (dict(racks=0), 8, "racks=0"),
    (dict(data=2.0, tensor=4), 8, "data=2.0"),
    (dict(data=True, tensor=8), 8, "data=True"),
    (dict(racks=-1, nvl_domain=0), 8, "nvl_domain=0"),
])
def test_library_mesh_errors_name_the_arguments(kwargs, n, named):
    with pytest.raises(MeshError) as info:
        make_mesh(devices=jax.devices()[:n], **kwargs)
    assert str(info.value).startswith(named + ":") and "\n" not in str(info.value)


def test_axis_sizes_take_the_rest_and_keep_tensor_groups_in_a_domain():
    assert axis_sizes(-1, 2, 8) == (4, 2) and axis_sizes(2, -1, 8) == (2, 4) and axis_sizes(144, 1, 144) == (144, 1)
    assert axis_sizes(36, 4, 144, nvl_domain=72, racked=True) == (36, 4)
    for args, kw, named in (((-1, 3, 8), {}, "tensor=3: does not divide the 8 devices"),
                            ((4, 4, 8), {}, "data=4 x tensor=4 = 16: must equal the 8 devices"),
                            ((-1, -1, 8), {}, "data=-1 and tensor=-1"),
                            ((-1, 4, 8), dict(nvl_domain=6, racked=True), "tensor=4: must divide nvl_domain=6"),
                            ((-1, 1, 8), dict(nvl_domain=3, racked=True), "nvl_domain=3: 8 devices span")):
        with pytest.raises(MeshError) as info:
            axis_sizes(*args, **kw)
        assert str(info.value).startswith(named), info.value


def test_the_run_renames_library_errors_after_its_config_keys():
    # Devices 0, 1, 2 and 4 fall into domains of 3 and 1 devices (nvl_domain 4).
    devices = [jax.devices()[i] for i in (0, 1, 2, 4)]
    with pytest.raises(MeshError, match=r"^nvl_domain=4: devices fall into NVLink domains of unequal sizes \[1, 3\]$"):
        make_mesh(tensor=2, racks=-1, nvl_domain=4, devices=devices)
    with pytest.raises(ConfigError) as info:
        build_mesh(MeshConfig(tensor=2, layout="gb200", nvl_domain=4), devices)
    assert str(info.value) == "mesh.nvl_domain=4: devices fall into NVLink domains of unequal sizes [1, 3]"
    with pytest.raises(ConfigError) as info:
        build_mesh(MeshConfig(tensor=2, layout="gb200", nvl_domain=4, racks=3))
    assert str(info.value) == "mesh.racks=3: the 8 devices fall into 2 NVLink domain(s) of mesh.nvl_domain=4"

_RACKS_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from train.config import MeshConfig
    from jax_nvfp4.mesh import describe
    from train.mesh import build_mesh
    def ids(m): return [[[d.id for d in row] for row in rack] for rack in m.devices] if m.devices.ndim == 3 else [[d.id for d in row] for row in m.devices]
    out = {"n": jax.device_count()}
    m = build_mesh(MeshConfig(tensor=4, layout="gb200", nvl_domain=72))
    out["gb200"] = ids(m); out["shape"] = dict(m.shape); out["describe"] = describe(m, 72)
    out["auto"] = ids(build_mesh(MeshConfig(tensor=4, nvl_domain=72)))
    m16 = build_mesh(MeshConfig(tensor=2, layout="gb200", nvl_domain=8), jax.devices()[:16])
    out["nvl8"] = ids(m16); out["describe8"] = describe(m16, 8)
    json.dump(out, sys.stdout)
""")


def test_two_nvl72_racks_simulated():
    env = dict(os.environ, XLA_FLAGS=xla_flags(144),
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _RACKS_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["n"] == 144 and out["shape"] == {"rack": 2, "data": 18, "tensor": 4}
    ids = np.array(out["gb200"])
    assert sorted(ids.ravel().tolist()) == list(range(144))
    _check_hybrid(ids, 72)
    np.testing.assert_array_equal(np.array(out["auto"]), ids.reshape(36, 4))
    assert out["describe"] == ("mesh rack=2 x data=18 x tensor=4 on 144 cpu devices, 2 NVLink domain(s) "
                               "of 72; rack: spans 2 domains; data: within one domain; tensor: within one domain")
    ids8 = np.array(out["nvl8"])
    assert ids8.shape == (2, 4, 2)
    _check_hybrid(ids8, 8)
    assert "2 NVLink domain(s) of 8" in out["describe8"]


_PROBE = textwrap.dedent("""
    import json, os, sys
    import jax
    jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))
    import numpy as np
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from train.config import MeshConfig
    from jax_nvfp4.mesh import describe
    from train.mesh import build_mesh
    mesh = build_mesh(MeshConfig(tensor=2, layout="gb200", nvl_domain=4))
    rows = mesh.shape["rack"] * mesh.shape["data"] // jax.process_count()
    local = np.full((rows, 1), jax.process_index() + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(("rack", "data"))), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    if jax.process_index() == 0:
        procs = [[d.process_index for d in row] for row in mesh.devices.reshape(-1, 2)]
        with open(sys.argv[1], "w") as f:
            json.dump({"procs": procs, "total": float(total), "n": jax.device_count(),
                       "describe": describe(mesh, 4)}, f)
    # Leave the distributed runtime while the interpreter is whole: a teardown at exit can corrupt
    # gloo's heap under load.
    total.block_until_ready()
    jax.distributed.shutdown()
""")


def _launch(tmp_path, n, body, *args, timeout=120):
    pkg = tmp_path / "probe"
    pkg.mkdir(exist_ok=True)
    (pkg / "__main__.py").write_text(body)
    env = dict(os.environ, PYTHON=sys.executable, LAUNCH_MODULE="probe",
               PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
               XLA_FLAGS=xla_flags(4))
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), str(n),
                           *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout)


def test_launch_local_two_processes_gloo(tmp_path):
    # Two processes x 4 CPU devices, one "NVLink domain" each: the domain comes from
    # process_index (the CPU runtime gives every device slice_index 0).
    out_file = tmp_path / "out.json"
    proc = _launch(tmp_path, 2, _PROBE, str(out_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(out_file.read_text())
    assert out["n"] == 8
    assert out["procs"] == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert out["total"] == 2 * 1 + 2 * 2  # a cross-process reduction over gloo
    assert "2 NVLink domain(s) of 4; rack: spans 2 domains; data: within one domain" in out["describe"]


def test_launch_local_stops_all_on_failure(tmp_path):
    body = textwrap.dedent("""
        import os, sys, time
        if os.environ["JAX_PROCESS_ID"] == "1":
            sys.exit(3)
        time.sleep(60)  # would block the launcher for a minute if not killed
    """)
    proc = _launch(tmp_path, 3, body, timeout=30)
    assert proc.returncode == 3
    assert "exited with status 3" in proc.stderr
    usage = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_local.sh")],
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


@pytest.mark.slow
def test_configure_host_devices():
    from train.mesh import configure_host_devices

    # conftest.py set XLA_FLAGS: the user's choice wins, nothing changes.
    assert configure_host_devices(MeshConfig(simulate_devices=4)) is None
    script = ("import jax; from train.config import MeshConfig; "
              "from train.mesh import configure_host_devices as c; "
              "print(c(MeshConfig(simulate_devices=3)), jax.device_count(), "
              "c(MeshConfig(simulate_devices=5)))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The second call comes after the backend started: it leaves the count alone.
    assert proc.stdout.split() == ["3", "3", "None"]
    # The scale benchmark's override: a count in XLA_FLAGS is dropped, not obeyed.
    script = ("from jax_nvfp4.mesh import simulate_cpu_devices as s; import jax; "
              "print(s(3, override=True), jax.device_count())")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["3", "3"]
