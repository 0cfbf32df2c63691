"""The fast tensor table reads what gguf.GGUFReader reads: the same tensors at the same offsets, the same scalar
fields, whatever metadata arrays (strings, numbers, nested arrays) stand before them."""
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from engine.model.gguf_file import TensorReader


def write_gguf(path) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("test.before", 7)
    writer.add_token_list([f"token-{i}" * (i % 5) for i in range(3000)])
    writer.add_token_scores([float(i) / 3 for i in range(3000)])
    writer.add_array("test.nested", [[1, 2, 3], [4], ["a", "bc"]])
    writer.add_string("test.name", "after the arrays")
    writer.add_float32("test.scale", 0.5)
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 40), dtype=np.float32))
    weights = rng.standard_normal((8, 64), dtype=np.float32)
    writer.add_tensor("blocks", quantize(weights, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_tensor_table_and_scalar_fields_equal_gguf_readers(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path)
    fast, reference = TensorReader(str(path)), GGUFReader(str(path))

    assert fast.alignment == reference.alignment == 64
    assert [t.name for t in fast.tensors] == [t.name for t in reference.tensors] == ["plain", "blocks"]
    for mine, theirs in zip(fast.tensors, reference.tensors):
        assert (mine.tensor_type, mine.data_offset, list(mine.shape)) == \
            (theirs.tensor_type, theirs.data_offset, list(theirs.shape))
        assert np.array_equal(mine.data, theirs.data)
    arrays = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "test.nested"}
    assert set(reference.fields) - set(fast.fields) == arrays
    for name, field in fast.fields.items():
        theirs = reference.fields[name]
        assert field.types == theirs.types and field.contents() == theirs.contents(), name
    assert reference.fields["test.nested"].types[0] == GGUFValueType.ARRAY
