"""The tiled MLP's tile sizes (ds_ulysses_ext/memory/tiling.py tile_sizes); the policy itself is tested in
tests/test_memory.py."""
import pytest

from ds_ulysses_ext.memory.tiling import tile_sizes


@pytest.mark.parametrize("tokens, tiles", [(20000, 3), (32768, 4), (24592, 5), (48, 3)])
def test_tiles_fall_on_multiples_of_16_tokens(tokens, tiles):
    # an FP8 linear's weight gradient reduces over its tile's tokens, which torch._scaled_mm takes in 16s only:
    # near-equal tiles of 20,000 tokens would be 6,667 + 6,667 + 6,666
    sizes = tile_sizes(tokens, tiles)
    assert len(sizes) == tiles and sum(sizes) == tokens and all(s % 16 == 0 for s in sizes), sizes
    assert max(sizes) - min(sizes) <= 16, sizes  # still near-equal


def test_tiles_of_counts_not_in_16s_stay_near_equal():
    assert tile_sizes(26, 7) == [4, 4, 4, 4, 4, 3, 3]  # the unaligned count: torch.tensor_split's sizes
    assert tile_sizes(32, 4) == [8, 8, 8, 8]  # fewer 16-token units than tiles: the agreed count is kept
