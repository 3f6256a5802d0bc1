"""Planner, pack/unpack and padded layout (fsdptrain/data/packing.py). Pure CPU, no model."""

import math
import random

import pytest
import torch

from fsdptrain.data.packing import (
    IGNORE_INDEX,
    pack_sequences,
    pad_sequences,
    plan_packs,
    unpack,
    unpack_responses,
)


def _reference_ffd_count(lengths, budget):
    """Independent first-fit-decreasing: the number of bins it opens."""
    bins = []
    for n in sorted(lengths, reverse=True):
        for b in range(len(bins)):
            if bins[b] + n <= budget:
                bins[b] += n
                break
        else:
            bins.append(n)
    return len(bins)


# --------------------------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------------------------


def test_plan_hand_example():
    # budget 8, lengths 5 4 3 3 2 1 (indices 0..5).
    # FFD: [5, 3(i2)] = 8, [4, 3(i3), 1] = 8, [2] = 2.
    # balance: gap 8-2=6, move 3(i2) (|6-6|=0 beats 5's |6-10|=4) -> loads 5, 8, 5;
    #          fullest 8 vs emptiest pack 0 (5): gap 3, only 1 is < 3 -> loads 6, 7, 5;
    #          gap 7-5=2: nothing in pack 1 (4, 3) is < 2 -> stop.
    plan = plan_packs([5, 4, 3, 3, 2, 1], 8)
    assert plan.packs == [[0, 5], [1, 3], [2, 4]]
    assert plan.pack_num_tokens == [6, 7, 5]
    assert plan.fill_efficiency == [6 / 8, 7 / 8, 5 / 8]
    assert plan.num_packs == 3


@pytest.mark.parametrize("seed", range(40))
def test_plan_properties_random(seed):
    rng = random.Random(seed)
    num_seqs = rng.randint(0, 60)
    budget = rng.randint(8, 400)
    # log-normal lengths, clipped to the budget, like RL responses
    lengths = [max(1, min(budget, int(rng.lognormvariate(3.0, 1.0)))) for _ in range(num_seqs)]
    min_packs = rng.choice([1, 1, 2, 5, num_seqs + 3])
    plan = plan_packs(lengths, budget, min_packs=min_packs)

    flat = sorted(i for pack in plan.packs for i in pack)
    assert flat == list(range(num_seqs)), "every sequence exactly once"
    loads = [sum(lengths[i] for i in pack) for pack in plan.packs]
    assert loads == plan.pack_num_tokens
    assert max(loads) <= budget, "budget never exceeded"
    assert plan.fill_efficiency == [load / budget for load in loads]
    assert plan.num_packs == max(_reference_ffd_count(lengths, budget), min_packs), "FFD's count, or the raised one"
    assert plan.num_packs >= math.ceil(sum(lengths) / budget)
    if lengths:
        assert max(loads) - min(loads) <= max(lengths), "balanced within the longest sequence"
    assert plan_packs(list(lengths), budget, min_packs=min_packs) == plan, "deterministic"


def test_plan_raised_count_gives_empty_packs():
    # FFD needs one pack [3, 3]; three are asked. Balance: gap 6 -> move one 3 (index 0 on the tie);
    # then gap 3-0 = 3 and a 3 does not narrow it -> [[1], [0], []].
    plan = plan_packs([3, 3], 10, min_packs=3)
    assert plan.packs == [[1], [0], []]
    assert plan.pack_num_tokens == [3, 3, 0]
    assert plan.fill_efficiency == [0.3, 0.3, 0.0]


def test_plan_no_sequences():
    assert plan_packs([], 8).packs == [[]]
    assert plan_packs([], 8, min_packs=2).packs == [[], []]
    assert plan_packs([], 8, min_packs=0).packs == []


def test_plan_over_long_sequence_names_length_and_budget():
    with pytest.raises(ValueError, match=r"sequence 1 has 9 tokens, more than the token budget of 8"):
        plan_packs([3, 9, 2], 8)


@pytest.mark.parametrize(
    ("lengths", "budget", "min_packs", "match"),
    [([0, 2], 8, 1, "at least one token"), ([2], 0, 1, "token_budget"), ([2], 8, -1, "min_packs")],
)
def test_plan_rejects_bad_arguments(lengths, budget, min_packs, match):
    with pytest.raises(ValueError, match=match):
        plan_packs(lengths, budget, min_packs=min_packs)


# --------------------------------------------------------------------------------------------------------------
# Packed layout
# --------------------------------------------------------------------------------------------------------------


def test_pack_layout_by_hand():
    # seq 0 = prompt [1, 2] + response [3]; seq 1 = prompt [5] + response [6, 7]; 1 padding position.
    packed = pack_sequences([[1, 2], torch.tensor([5])], [[3], torch.tensor([6, 7])], pad_to=7)
    assert packed.input_ids.tolist() == [[1, 2, 3, 5, 6, 7, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 6]
    assert packed.segment_cu_seqlens().tolist() == [0, 3, 6, 7]
    # label at t = token t+1 of the same sequence; never seq 1's first token at seq 0's end
    assert packed.labels.tolist() == [[2, 3, IGNORE_INDEX, 6, 7, IGNORE_INDEX, IGNORE_INDEX]]
    assert packed.label_mask.tolist() == [[True, True, False, True, True, False, False]]
    # seq 0 (P=2): t=0 scores 2 (prompt), t=1 scores 3 (response); seq 1 (P=1): t=0 scores 6, t=1 scores 7
    assert packed.response_mask.tolist() == [[False, True, False, True, True, False, False]]
    assert packed.seq_index.tolist() == [[0, 0, 0, 1, 1, 1, 2]]
    assert (packed.num_seqs, packed.num_tokens, packed.total_len, packed.num_pad_tokens) == (2, 6, 7, 1)
    assert (packed.prompt_lengths, packed.response_lengths, packed.seq_lengths) == ([2, 1], [1, 2], [3, 3])
    assert packed.max_seqlen == 3
    assert packed.num_response_tokens == 3


def test_pack_indices_choose_and_order():
    prompts, responses = [[1], [2, 2], [3, 3, 3]], [[10], [20], [30]]
    packed = pack_sequences(prompts, responses, [2, 0])
    assert packed.input_ids.tolist() == [[3, 3, 3, 30, 1, 10]]
    assert packed.cu_seqlens.tolist() == [0, 4, 6]
    assert packed.segment_cu_seqlens().tolist() == [0, 4, 6], "no tail, no extra segment"


def _random_sequences(rng, num_seqs, vocab=50):
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(num_seqs)]
    responses = [[rng.randrange(vocab) for _ in range(rng.randint(0, 9))] for _ in range(num_seqs)]
    return prompts, responses


@pytest.mark.parametrize("seed", range(5))
def test_pack_unpack_round_trip_exact(seed):
    rng = random.Random(seed)
    prompts, responses = _random_sequences(rng, rng.randint(1, 8))
    pad = rng.choice([None, 3])
    num_tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    packed = pack_sequences(prompts, responses, pad_to=None if pad is None else num_tokens + pad)

    seqs = unpack(packed.input_ids, packed)
    assert [s.tolist() for s in seqs] == [p + r for p, r in zip(prompts, responses)]
    # [T] input works the same as [1, T]; extra trailing dims ride along
    assert [s.tolist() for s in unpack(packed.input_ids[0], packed)] == [s.tolist() for s in seqs]
    values = torch.arange(packed.total_len * 3, dtype=torch.float32).view(1, packed.total_len, 3)
    assert [s.shape[0] for s in unpack(values, packed)] == packed.seq_lengths
    assert torch.equal(torch.cat(unpack(values, packed)), values[0, : packed.num_tokens])

    # the label at each response-scoring position is that response token itself
    assert [s.tolist() for s in unpack_responses(packed.labels, packed)] == responses
    assert all(s.all() for s in unpack_responses(packed.response_mask, packed))
    assert int(packed.response_mask.sum()) == sum(len(r) for r in responses)
    # positions restart at 0 per sequence
    assert [s.tolist() for s in unpack(packed.position_ids, packed)] == [list(range(n)) for n in packed.seq_lengths]


def test_empty_pack_is_one_masked_token():
    packed = pack_sequences([], [])
    assert packed.input_ids.tolist() == [[0]]
    assert packed.position_ids.tolist() == [[0]]
    assert packed.cu_seqlens.tolist() == [0]
    assert packed.segment_cu_seqlens().tolist() == [0, 1]
    assert packed.labels.tolist() == [[IGNORE_INDEX]]
    assert not packed.label_mask.any() and not packed.response_mask.any()
    assert (packed.num_seqs, packed.num_tokens, packed.max_seqlen) == (0, 0, 1)
    assert unpack(torch.zeros(1, 1, 5), packed) == []
    assert unpack_responses(torch.zeros(1, 1), packed) == []

    padded = pack_sequences([[1]], [[2]], [], pad_to=4)
    assert padded.input_ids.tolist() == [[0, 0, 0, 0]] and padded.num_seqs == 0
    assert padded.position_ids.tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("prompts", "responses", "pad_to", "match"),
    [
        ([[1, 2]], [[3]], 2, "pad_to=2 is shorter"),
        ([[]], [[3]], None, "prompt 0 is empty"),
        ([[1]], [[3], [4]], None, "1 prompts but 2 responses"),
        ([torch.ones(2, 2, dtype=torch.long)], [[3]], None, "1-D"),
    ],
)
def test_pack_rejects_bad_input(prompts, responses, pad_to, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(prompts, responses, pad_to=pad_to)


def test_unpack_rejects_wrong_length():
    packed = pack_sequences([[1]], [[2]])
    with pytest.raises(ValueError, match="do not match the pack's row of 2"):
        unpack(torch.zeros(3), packed)


def test_to_moves_every_tensor():
    packed = pack_sequences([[1]], [[2]]).to("meta")
    assert packed.input_ids.is_meta and packed.cu_seqlens.is_meta and packed.response_mask.is_meta
    assert packed.seq_lengths == [2]


# --------------------------------------------------------------------------------------------------------------
# Padded layout
# --------------------------------------------------------------------------------------------------------------


def test_pad_layout_by_hand():
    padded = pad_sequences([[1, 2], [5]], [[3], [6, 7, 8]])
    assert padded.input_ids.tolist() == [[1, 2, 3, 0], [5, 6, 7, 8]]
    assert padded.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert padded.labels.tolist() == [[2, 3, IGNORE_INDEX, IGNORE_INDEX], [6, 7, 8, IGNORE_INDEX]]
    assert padded.label_mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert padded.response_mask.tolist() == [[False, True, False, False], [True, True, True, False]]
    assert (padded.num_seqs, padded.num_tokens) == (2, 7)


@pytest.mark.parametrize("seed", range(3))
def test_packed_and_padded_align_the_same(seed):
    rng = random.Random(100 + seed)
    prompts, responses = _random_sequences(rng, 6)
    packed = pack_sequences(prompts, responses)
    padded = pad_sequences(prompts, responses, pad_to=12 + 9)
    for b, (labels, mask) in enumerate(zip(unpack(packed.labels, packed), unpack(packed.response_mask, packed))):
        n = packed.seq_lengths[b]
        assert torch.equal(labels, padded.labels[b, :n])
        assert torch.equal(mask, padded.response_mask[b, :n])
        assert torch.equal(padded.labels[b][padded.response_mask[b]], torch.tensor(responses[b], dtype=torch.long))
    assert int(padded.response_mask.sum()) == int(packed.response_mask.sum())


def test_pad_rejects_no_sequences():
    with pytest.raises(ValueError, match="at least one sequence"):
        pad_sequences([], [])


@pytest.mark.parametrize("seed", range(5))
def test_position_ids_restart_at_every_segment_the_model_sees(seed):
    """What the model receives (`packed_model_inputs`): position ids 0..n-1 within every segment of `cu_seq_lens`,
    the padding tail included, and never a position that runs on across a boundary."""
    from fsdptrain.model.attention_switch import packed_model_inputs

    rng = random.Random(seed)
    num = rng.randint(1, 6)
    prompts = [[rng.randint(1, 9) for _ in range(rng.randint(1, 5))] for _ in range(num)]
    responses = [[rng.randint(1, 9) for _ in range(rng.randint(1, 5))] for _ in range(num)]
    real = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    inputs = packed_model_inputs(pack_sequences(prompts, responses, pad_to=real + rng.randint(0, 3)))
    cu = inputs["cu_seq_lens_q"].tolist()
    positions = inputs["position_ids"][0].tolist()
    assert cu[0] == 0 and cu[-1] == len(positions)
    for start, end in zip(cu, cu[1:]):
        assert positions[start:end] == list(range(end - start)), (cu, positions)
    restarts = [t for t, p in enumerate(positions) if p == 0]
    assert restarts == cu[:-1]  # a restart exactly at every segment start, nowhere else


# ---- the per-token response mask (multi-turn: tokens a tool wrote) -------------------------------------------------


def test_response_mask_takes_tool_tokens_out_of_the_packed_and_padded_rows_by_hand():
    # seq 0: prompt [1, 2], response [3, 4, 5, 6] with mask [1, 0, 0, 1] (a tool wrote 4, 5);
    # seq 1: prompt [7], response [8, 9] with mask [1, 0] (a cut tool segment at the end); seq 2 has no mask
    prompts, responses = [[1, 2], [7], [10]], [[3, 4, 5, 6], [8, 9], [11]]
    masks = [[1, 0, 0, 1], torch.tensor([1, 0]), None]
    packed = pack_sequences(prompts, responses, response_masks=masks, pad_to=12)
    # position t scores token t+1: seq 0 at 1..4 (tokens 3, 4, 5, 6), seq 1 at 6, 7 (8, 9), seq 2 at 9 (11)
    positions = [0, 1, 1, 1, 1, 0, 1, 1, 0, 1, 0, 0, 0]
    policy = [0, 1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0]
    assert packed.response_positions[0].tolist() == [bool(x) for x in positions[:12]]
    assert packed.response_mask[0].tolist() == [bool(x) for x in policy[:12]]
    assert packed.num_response_tokens == 7 and int(packed.response_mask.sum()) == 4
    padded = pad_sequences(prompts, responses, response_masks=masks)
    assert padded.response_mask.tolist() == [[False, True, False, False, True, False],
                                             [True, False, False, False, False, False],
                                             [True, False, False, False, False, False]]
    assert padded.response_positions.sum(dim=1).tolist() == [4, 2, 1]


def test_no_mask_and_all_ones_give_the_same_rows():
    prompts, responses = [[1, 2], [7]], [[3, 4, 5], [8, 9]]
    plain = pack_sequences(prompts, responses)
    ones = pack_sequences(prompts, responses, response_masks=[[1, 1, 1], None])
    assert torch.equal(plain.response_mask, ones.response_mask)
    assert torch.equal(plain.response_mask, plain.response_positions)


@pytest.mark.parametrize("masks, fragment", [
    ([[1, 0]], "response mask 0 has 2 entries for 3 response tokens"),
    ([[1, 1, 1], None], "got 2 response masks for 1 responses"),
])
def test_a_response_mask_of_the_wrong_length_is_refused(masks, fragment):
    with pytest.raises(ValueError, match=fragment):
        pack_sequences([[1]], [[2, 3, 4]], response_masks=masks)
