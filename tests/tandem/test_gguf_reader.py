"""The GGUF reader and dequantizer against their oracles: gguf.GGUFReader and gguf.quants."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tandem.config import UnsupportedModelError
from tandem.loaders import CheckpointError, load_checkpoint
from tandem.loaders.gguf_dequant import dequantize
from tandem.loaders.gguf_reader import GGUFFile

QUANTIZED = [Q.Q8_0, Q.Q4_0, Q.Q4_1]


def _oracle_metadata(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _assert_matches_oracle(path: Path) -> GGUFFile:
    ours, oracle = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.metadata == _oracle_metadata(oracle)
    assert ours.data_offset == oracle.data_offset
    assert list(ours.tensors) == [t.name for t in oracle.tensors]
    for tensor in oracle.tensors:
        info = ours.tensors[tensor.name]
        assert (info.shape, info.ggml_type) == (tuple(int(d) for d in tensor.shape), tensor.tensor_type)
        assert ours.data_offset + info.offset == tensor.data_offset
        data = ours.tensor_data(tensor.name)
        assert isinstance(data, np.memmap)
        assert data.tobytes() == tensor.data.tobytes()
    return ours


def test_embedded_file_matches_gguf_reader(smollm2_path: Path) -> None:
    ours = _assert_matches_oracle(smollm2_path)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"):  # Q8_0, Q4_1, F32
        info = ours.tensors[name]
        expected = gguf_dequantize(ours.tensor_data(name), info.ggml_type)
        assert np.array_equal(dequantize(ours.tensor_data(name), info.ggml_type), expected)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], alignment: int | None = None,
           endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("test.u8", 255)
    writer.add_int16("test.i16", -7)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "naïve 日本語 🤗")
    writer.add_array("test.strings", ["a", "", "ü", "three"])
    writer.add_array("test.floats", [0.5, -1.25])
    for name, (array, ggml_type) in tensors.items():
        writer.add_tensor(name, gguf_quantize(array, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _random_tensors() -> dict[str, tuple[np.ndarray, Q]]:
    rng = np.random.default_rng(0)
    shapes = {Q.F32: (3, 5), Q.F16: (7,), Q.Q8_0: (4, 64), Q.Q4_0: (2, 3, 32), Q.Q4_1: (1, 96)}
    return {f"t.{t.name}": (rng.standard_normal(shape).astype(np.float32), t) for t, shape in shapes.items()}


@pytest.mark.parametrize("alignment", [None, 64])
def test_written_file_round_trips(tmp_path: Path, alignment: int | None) -> None:
    tensors = _random_tensors()
    ours = _assert_matches_oracle(_write(tmp_path / "small.gguf", tensors, alignment))
    assert ours.data_offset % (alignment or 32) == 0
    assert ours.metadata["test.text"] == "naïve 日本語 🤗"
    assert ours.metadata["test.strings"] == ["a", "", "ü", "three"]
    for name, (array, ggml_type) in tensors.items():
        assert ours.tensors[name].shape == tuple(reversed(array.shape))
        loaded = dequantize(ours.tensor_data(name), ggml_type)
        expected = gguf_dequantize(gguf_quantize(array, ggml_type), ggml_type)  # for F32, the array itself
        assert loaded.dtype == np.float32 and loaded.flags.writeable
        assert np.array_equal(loaded, expected)


def test_nested_arrays_keep_their_shape(tmp_path: Path) -> None:
    """gguf.GGUFReader flattens these, so no oracle here."""
    writer = gguf.GGUFWriter(str(tmp_path / "nested.gguf"), "llama")
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.words", [["a"], ["b", "c"]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    metadata = GGUFFile(tmp_path / "nested.gguf").metadata
    assert (metadata["test.nested"], metadata["test.words"]) == ([[1, 2], [3]], [["a"], ["b", "c"]])


def test_big_endian_metadata(tmp_path: Path) -> None:
    path = _write(tmp_path / "big.gguf", {"t": (np.ones(4, np.float32), Q.F32)}, endianess=gguf.GGUFEndian.BIG)
    assert GGUFFile(path).metadata == _oracle_metadata(gguf.GGUFReader(path))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
@pytest.mark.parametrize("ggml_type", QUANTIZED)
@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (5, 2, 160)])
def test_dequantize_is_bit_exact(ggml_type: Q, shape: tuple[int, ...]) -> None:
    """Random bytes are valid blocks too: any float16 scale, NaN and infinity included."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    byte_shape = (*shape[:-1], shape[-1] // block_size * type_size)
    data = np.random.default_rng(1).integers(0, 256, byte_shape, dtype=np.uint8)
    expected = gguf_dequantize(data, ggml_type)
    assert np.array_equal(dequantize(data, ggml_type).view(np.uint32), expected.view(np.uint32))


def test_corrupt_files_raise_checkpoint_error(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.gguf", _random_tensors()).read_bytes()
    last_tensor_end = len(good) - 4  # t.Q4_1: 3 blocks of 20 bytes, then 4 bytes of padding
    cases = [
        ("no such GGUF file", None),
        ("not a GGUF file", b""),
        ("not a GGUF file", b"GGML" + good[4:]),
        ("truncated GGUF file: tensor t.Q4_1 ends at byte", good[: last_tensor_end - 1]),
        ("GGUF string is not UTF-8", good.replace(b"three", b"\xffthre")),
    ]
    for i, (message, content) in enumerate(cases):
        path = tmp_path / f"bad{i}.gguf"
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(CheckpointError, match=message):
            GGUFFile(path)


def test_every_truncation_raises_checkpoint_error(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.gguf", _random_tensors()).read_bytes()
    path = tmp_path / "cut.gguf"
    for size in range(0, len(good) - 4, 3):
        path.write_bytes(good[:size])
        with pytest.raises(CheckpointError, match="truncated|not a GGUF"):
            GGUFFile(path)


def test_unsupported_version(tmp_path: Path) -> None:
    path = _write(tmp_path / "v1.gguf", {})
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + path.read_bytes()[8:])
    with pytest.raises(CheckpointError, match="GGUF version 1 is not supported"):
        GGUFFile(path)


def _write_model(path: Path, arch: str, norm: np.ndarray) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length",
                "attention.head_count"):
        writer.add_uint32(f"{arch}.{key}", 8)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'bert'"):
        load_checkpoint(_write_model(tmp_path / "bert.gguf", "bert", np.ones(8, np.float32)))
    with pytest.raises(CheckpointError, match="has GGUF type I32; supported: "):
        load_checkpoint(_write_model(tmp_path / "int.gguf", "llama", np.ones(8, np.int32)))
