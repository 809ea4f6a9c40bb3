"""The built-in standard-library corpus and the block dataset."""
import pytest
import torch

from zerotrain.data import TokenBlockDataset, iter_stdlib_sources, load_stdlib_corpus, split


def test_corpus_is_bounded_deterministic_bytes():
    a = load_stdlib_corpus(max_bytes=100_000)
    b = load_stdlib_corpus(max_bytes=100_000)
    assert a.dtype == torch.uint8 and a.dim() == 1
    assert a.numel() == 100_000
    assert torch.equal(a, b)
    # A shorter read is a prefix of a longer one.
    assert torch.equal(load_stdlib_corpus(max_bytes=1000), a[:1000])
    # It is Python source text.
    text = bytes(a[:20_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_sources_are_sorted_and_skip_site_packages():
    paths = list(iter_stdlib_sources())
    assert len(paths) > 100
    assert all(p.suffix == ".py" for p in paths)
    assert not any("site-packages" in p.parts for p in paths)


def test_corpus_from_custom_root(tmp_path):
    (tmp_path / "b.py").write_text("second\n")
    (tmp_path / "a.py").write_text("first")  # no trailing newline: one is added
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("third\n")
    (tmp_path / "notes.txt").write_text("ignored\n")
    corpus = load_stdlib_corpus(max_bytes=None, root=tmp_path)
    assert bytes(corpus.tolist()) == b"first\nsecond\nthird\n"
    with pytest.raises(ValueError):
        load_stdlib_corpus(max_bytes=0)


def test_block_dataset_pairs_are_shifted_and_disjoint():
    tokens = torch.arange(23, dtype=torch.uint8)
    ds = TokenBlockDataset(tokens, block_size=5)
    assert len(ds) == 4  # (23 - 1) // 5
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == torch.int64 and y.dtype == torch.int64
        assert x.tolist() == list(range(5 * i, 5 * i + 5))
        assert y.tolist() == list(range(5 * i + 1, 5 * i + 6))
    assert torch.equal(ds[-1][0], ds[3][0])
    with pytest.raises(IndexError):
        ds[4]
    # Exactly enough for one more block once the target shift fits.
    assert len(TokenBlockDataset(torch.arange(21, dtype=torch.uint8), 5)) == 4
    assert len(TokenBlockDataset(torch.arange(20, dtype=torch.uint8), 5)) == 3


def test_block_dataset_works_with_dataloader():
    ds = TokenBlockDataset(load_stdlib_corpus(max_bytes=10_000), block_size=64)
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert x.shape == y.shape == (4, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_split_is_a_contiguous_cut():
    tokens = torch.arange(100, dtype=torch.uint8)
    train, val = split(tokens, 0.1)
    assert train.numel() == 90 and val.numel() == 10
    assert torch.equal(torch.cat([train, val]), tokens)
    train, val = split(tokens, 0.0)
    assert train.numel() == 100 and val.numel() == 0
    with pytest.raises(ValueError):
        split(tokens, 1.0)


def test_default_corpus_is_8_mib_and_degenerate_streams_and_blocks_are_handled():
    """`zerotrain train`'s default corpus (`--max-corpus-bytes`, DEFAULT_MAX_BYTES) is the first 8 MiB of the
    stdlib; a stream too short for one block (0 or 1 tokens) gives no blocks; a block size of 0 is refused."""
    corpus = load_stdlib_corpus()
    assert corpus.numel() == 8 * 1024 * 1024
    assert torch.equal(corpus[-1000:], load_stdlib_corpus(max_bytes=8 * 1024 * 1024 + 1000)[-2000:-1000])
    assert len(TokenBlockDataset(torch.zeros(0, dtype=torch.uint8), 4)) == 0
    assert len(TokenBlockDataset(torch.zeros(1, dtype=torch.uint8), 1)) == 0
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        TokenBlockDataset(torch.arange(10, dtype=torch.uint8), 0)
