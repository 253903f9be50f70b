"""Bitstream packing and states <-> words: property tests and the tail-biting wrap."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from escha.format import pack_bits, states_from_words, unpack_bits, words_from_states
from escha.format.spec import SUPPORTED_BITS

bits_st = st.sampled_from(SUPPORTED_BITS)


@settings(max_examples=50, deadline=None)
@given(n_words=st.integers(1, 24), lead=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(n_words, lead, seed):
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31, (lead, n_words), generator=g, dtype=torch.int64).to(torch.int32)
    bits = unpack_bits(words)
    assert bits.shape == (lead, 32 * n_words)
    assert torch.equal(pack_bits(bits), words)


def test_unpack_is_msb_first():
    words = torch.tensor([0x80000001, 0x40000000], dtype=torch.int64).to(torch.int32)
    bits = unpack_bits(words)
    assert bits[0] == 1 and bits[31] == 1 and bits[33] == 1
    assert int(bits.sum()) == 3


@settings(max_examples=40, deadline=None)
@given(k=bits_st, tiles=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_states_words_round_trip(k, tiles, seed):
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31, (tiles, 8 * k), generator=g, dtype=torch.int64).to(torch.int32)
    states = states_from_words(words, k)
    assert states.shape == (tiles, 256)
    assert int(states.min()) >= 0 and int(states.max()) <= 0xFFFF
    # consecutive states overlap in 16-K bits: the bit-shift trellis
    s = states.to(torch.int64)
    nxt = torch.roll(s, -1, dims=-1)
    assert torch.equal((s << k) & 0xFFFF, nxt & (0xFFFF ^ ((1 << k) - 1)))
    assert torch.equal(words_from_states(states, k), words)


@pytest.mark.parametrize("k", SUPPORTED_BITS)
def test_tail_biting_wrap(k):
    """The last states' windows run past the end of the stream and wrap onto its first bits."""
    g = torch.Generator().manual_seed(k)
    words = torch.randint(-2**31, 2**31, (8 * k,), generator=g, dtype=torch.int64).to(torch.int32)
    stream = unpack_bits(words).tolist()
    n = 256 * k
    states = states_from_words(words, k).tolist()
    for j in (0, 1, 255 - 16 // k, 254, 255):
        want = 0
        for i in range(16):
            want = (want << 1) | stream[(k * j + i) % n]
        assert states[j] == want, (j, states[j], want)
    # state 255's low bits are the first bits of the stream
    low = 16 - k
    assert states[255] & ((1 << low) - 1) == states[0] >> k


def test_known_state_k2():
    # stream starts 0xABCD_1234...: state 0 = 0xABCD, state 1 = bits 2..17
    words = torch.zeros(16, dtype=torch.int64)
    words[0] = 0xABCD1234
    words = words.to(torch.int32)
    states = states_from_words(words, 2)
    assert states[0] == 0xABCD
    assert states[1] == (0xABCD1234 >> 14) & 0xFFFF
    assert states[8] == 0x1234


def test_words_from_states_rejects_invalid_walk():
    g = torch.Generator().manual_seed(1)
    words = torch.randint(-2**31, 2**31, (2, 16), generator=g, dtype=torch.int64).to(torch.int32)
    states = states_from_words(words, 2)
    states[1, 100] ^= 0x0100  # breaks the overlap with its neighbours
    with pytest.raises(ValueError, match=r"not a tail-biting trellis walk.*\[1, 100\]"):
        words_from_states(states, 2)


def test_bad_inputs():
    with pytest.raises(TypeError, match="int32"):
        unpack_bits(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_bits(torch.zeros(31, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0 or 1"):
        pack_bits(torch.full((32,), 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="has 16 words"):
        states_from_words(torch.zeros(15, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        states_from_words(torch.zeros(16, dtype=torch.int32), 5)
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        words_from_states(torch.full((256,), 70000), 2)
