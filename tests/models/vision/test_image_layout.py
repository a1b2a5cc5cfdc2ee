"""Image prompt layout vs transformers' `get_rope_index` (two images with text between, text after)."""

import torch

from freetoken.errors import FreetokenError
from freetoken.models.vision.prompt import image_layout
from tests.conftest import FIXTURES

PAD, START, END = 1022, 1020, 1021


def test_positions_and_rope_delta_match_get_rope_index():
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    grids = [(1, 4, 6), (1, 10, 4)]
    ids = [5, 6, START, PAD, END, 7, 8, 9, START, PAD, END, 10, 11]
    layout = image_layout(ids, PAD, grids, merge=2)
    config = AutoConfig.from_pretrained(FIXTURES / "qwen35_dense" / "hf")
    x = torch.tensor([layout.token_ids])
    # get_rope_index reads only the config's merge size: called unbound on a stand-in holding the config
    want, delta = Qwen3_5Model.get_rope_index(
        type("M", (), {"config": config, "get_vision_position_ids": Qwen3_5Model.get_vision_position_ids})(),
        x, (x == PAD).int(), image_grid_thw=torch.tensor(grids))
    assert torch.equal(layout.positions, want[:, 0])
    assert layout.rope_delta == int(delta)
    assert layout.pad_spans == ((3, 9), (14, 24))


def test_verified_example():
    # architectures.md §9: [0,1,2 | t:3x6, h:3,3,3,4,4,4, w:3,4,5,3,4,5 | 6,7,8]
    layout = image_layout([1, 2, 3, PAD, 4, 5, 6], PAD, [(1, 4, 6)], merge=2)
    assert layout.positions.tolist() == [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8], [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8],
                                         [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]]
    assert layout.rope_delta == 9 - 12


def test_placeholder_count_must_match_the_images():
    try:
        image_layout([1, PAD, 2], PAD, [(1, 4, 4), (1, 4, 4)], merge=2)
    except FreetokenError as exc:
        assert "1 image placeholder(s) for 2 image(s)" in str(exc)
    else:
        raise AssertionError("no error")
