"""validate_mesh_shape: the pure check the CLI runs in the parent before any rank starts."""

import pytest

from fsdptrain.distributed.world import validate_mesh_shape


@pytest.mark.parametrize(
    ("world_size", "dp_replicate", "dp_shard", "expected"),
    [
        (1, 1, None, (1, 1)),  # a single process
        (8, 1, None, (1, 8)),  # FSDP, auto: 8 / 1
        (8, 2, None, (2, 4)),  # HSDP, auto: 8 / 2
        (8, 8, None, (8, 1)),  # pure replication
        (8, 2, 4, (2, 4)),  # explicit and consistent
        (4, 1, 4, (1, 4)),
    ],
)
def test_valid_shapes(world_size, dp_replicate, dp_shard, expected):
    assert validate_mesh_shape(world_size, dp_replicate, dp_shard) == expected


@pytest.mark.parametrize(
    ("world_size", "dp_replicate", "dp_shard", "message"),
    [
        (8, 3, None, "does not divide the world size 8"),  # auto cannot split 8 ranks into 3 replicas
        (8, 2, 2, "2 x 2 = 4 but the world size is 8"),
        (4, 1, 8, "1 x 8 = 8 but the world size is 4"),
        (4, 0, None, "dp_replicate must be a positive integer"),
        (4, 1, 0, "dp_shard must be a positive integer or auto"),
        (4, 1.5, None, "dp_replicate must be a positive integer"),
        (0, 1, None, "world size must be a positive integer"),
    ],
)
def test_invalid_shapes_name_the_fix(world_size, dp_replicate, dp_shard, message):
    with pytest.raises(ValueError) as excinfo:
        validate_mesh_shape(world_size, dp_replicate, dp_shard)
    assert message in str(excinfo.value)


def test_mismatch_message_offers_auto():
    with pytest.raises(ValueError) as excinfo:
        validate_mesh_shape(8, 2, 2)
    assert "parallel.dp_shard=auto" in str(excinfo.value)


@pytest.mark.parametrize("world_size, dp_replicate, dp_shard, cp, expected", [
    (2, 1, None, 2, (1, 1)),
    (4, 1, None, 2, (1, 2)),
    (8, 2, None, 2, (2, 2)),
    (8, 2, 2, 2, (2, 2)),
])
def test_cp_is_the_third_factor_of_the_world(world_size, dp_replicate, dp_shard, cp, expected):
    assert validate_mesh_shape(world_size, dp_replicate, dp_shard, cp) == expected


def test_bad_cp_layouts_name_the_fix():
    with pytest.raises(ValueError, match="parallel.cp=3 does not divide the world size 4"):
        validate_mesh_shape(4, 1, None, 3)
    with pytest.raises(ValueError, match="with parallel.cp=2 the data-parallel ranks are the world size / cp = 2"):
        validate_mesh_shape(4, 1, 4, 2)
