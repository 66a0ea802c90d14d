"""`Mesh`: parsing, -1, validation against the device count with an error that says what fits."""

import pytest

from ember.core.mesh import Mesh, MeshError


def test_parse_and_views():
    m = Mesh.parse("dp=2, tp=4", backend="xla")
    assert m.names == ("dp", "tp") and m.shape == (2, 4) and m.size == 8 and m.backend == "xla"
    assert m["tp"] == 4 and "dp" in m and "fsdp" not in m and m.sizes() == {"dp": 2, "tp": 4}
    assert str(m) == "dp=2,tp=4" and Mesh.parse(str(m), backend="xla") == m


def test_minus_one_takes_the_rest():
    assert Mesh.parse("dp=-1,tp=4", devices=32, backend="xla").shape == (8, 4)
    assert Mesh.parse("fsdp=-1", devices=4, backend="dtensor").shape == (4,)


@pytest.mark.parametrize(
    "text, devices, match",
    [
        ("dp=3", 8, r"mesh 'dp=3' needs 3 devices but 8 are available.*--mesh dp=8 \(or dp=-1"),
        ("dp=4,tp=4", 8, r"needs 16 devices but 8 are available.*--mesh dp=2,tp=4"),
        ("dp=2,tp=3", 8, r"needs 6 devices.*--mesh dp=8,tp=1"),
        ("dp=-1,tp=3", 8, r"the other axes use 3 devices, which does not divide the 8 available"),
        ("dp=-1,tp=-1", 8, r"only one mesh axis may be -1"),
        ("dp", 8, r"cannot parse mesh axis 'dp'.*expected name=size"),
        ("dp=x", 8, r"cannot parse mesh axis 'dp=x'"),
        ("dp=2,dp=4", 8, r"mesh axis 'dp' appears twice"),
        ("dp=0", 8, r"sizes must be >= 1"),
        ("", 8, r"empty mesh"),
        ("1x=8", 8, r"not an identifier"),
    ],
)
def test_bad_meshes_name_the_fix(text, devices, match):
    with pytest.raises(MeshError, match=match):
        Mesh.parse(text, devices=devices, backend="xla")


def test_minus_one_needs_a_device_count_and_backend_is_checked():
    with pytest.raises(MeshError, match="device count is unknown"):
        Mesh.parse("dp=-1", backend="xla")
    with pytest.raises(MeshError, match="backend 'tpu' is not one of"):
        Mesh.parse("dp=2", backend="tpu")


def test_backend_defaults_from_the_environment(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert Mesh.parse("dp=2").backend == "dtensor"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert Mesh.parse("dp=2").backend == "xla"
