import pytest
import torch

from lightning_dynmo.data import ByteBlockDataset, ByteTextDataModule, load_text_bytes


def test_default_source_is_large_and_offline():
    data = load_text_bytes(None)
    assert len(data) > 400_000
    assert data == load_text_bytes(None)  # deterministic order


def test_shapes_dtypes_and_shift():
    dm = ByteTextDataModule(block_size=16, batch_size=4)
    dm.setup("fit")
    x, y = dm.train_dataset[3]
    assert x.shape == y.shape == (16,)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == yb.shape == (4, 16) and xb.dtype == torch.int64
    assert torch.equal(xb[:, 1:], yb[:, :-1])
    assert int(xb.max()) < 256 and int(xb.min()) >= 0
    vx, vy = next(iter(dm.val_dataloader()))
    assert vx.shape == (4, 16)


def test_split_by_position_and_seeded_shuffle():
    dm = ByteTextDataModule(block_size=32, batch_size=8, val_fraction=0.1)
    dm.setup()
    n_total = len(dm.train_dataset.data) + len(dm.val_dataset.data)
    assert len(dm.val_dataset.data) == int(n_total * 0.1)
    raw = load_text_bytes(None)
    assert bytes(dm.val_dataset.data[:50].tolist()) == raw[n_total - len(dm.val_dataset.data):][:50]
    a = next(iter(dm.train_dataloader()))[0]
    b = next(iter(ByteTextDataModule(block_size=32, batch_size=8, val_fraction=0.1).train_dataloader()))[0]
    assert torch.equal(a, b)
    v1 = next(iter(dm.val_dataloader()))[0]
    assert bytes(v1[0].tolist()) == bytes(dm.val_dataset.data[:32].tolist())  # no shuffle


def test_stride():
    data = torch.arange(100, dtype=torch.uint8)
    ds = ByteBlockDataset(data, block_size=10, stride=5)
    assert len(ds) == (100 - 11) // 5 + 1
    x, y = ds[1]
    assert x.tolist() == list(range(5, 15)) and y.tolist() == list(range(6, 16))
    x, _ = ds[len(ds) - 1]
    assert int(x[-1]) <= 98


def test_file_source(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello world! " * 100)
    dm = ByteTextDataModule(path=f, block_size=8, batch_size=2, val_fraction=0.2)
    dm.setup()
    assert len(dm.train_dataset.data) + len(dm.val_dataset.data) == 1300
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 8)
    assert ByteTextDataModule.decode(ByteTextDataModule.encode("héllo")) == "héllo"


def test_folder_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("B" * 50)
    (tmp_path / "sub" / "c.txt").write_text("C" * 50)
    (tmp_path / "a.txt").write_text("A" * 50)
    (tmp_path / "ignored.py").write_text("X" * 50)
    data = load_text_bytes(tmp_path)
    assert data == b"A" * 50 + b"\n" + b"B" * 50 + b"\n" + b"C" * 50
    dm = ByteTextDataModule(path=str(tmp_path), block_size=8, batch_size=2, val_fraction=0.2)
    dm.setup()
    assert len(dm.train_dataset) > 0


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        ByteTextDataModule(path=tmp_path / "missing.txt").setup()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        ByteTextDataModule(path=empty).setup()
    short = tmp_path / "short.txt"
    short.write_text("x" * 20)
    with pytest.raises(ValueError, match="block_size"):
        ByteTextDataModule(path=short, block_size=32).setup()
    with pytest.raises(ValueError, match="block_size"):  # too short once split
        ByteTextDataModule(path=short, block_size=16, val_fraction=0.5).setup()
    d = tmp_path / "nofiles"
    d.mkdir()
    with pytest.raises(ValueError, match="no \\*.txt"):
        ByteTextDataModule(path=d).setup()
    with pytest.raises(ValueError, match="val_fraction"):
        ByteTextDataModule(val_fraction=0.0)
