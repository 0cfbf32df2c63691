"""The loaded model: on the CPU its Linear weights are stored input-major, with the same values."""
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.model.model_loader import load_model


def test_cpu_linear_weights_keep_their_values_and_shape_in_input_major_storage(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    loaded = load_model(ModelConfig(model=tiny_model_dir, device="cpu")).model
    linears = {name: m for name, m in loaded.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head" in linears and len(linears) > 2
    reference_weights = dict(reference.named_parameters())
    for name, module in linears.items():
        weight = module.weight
        assert weight.t().is_contiguous() and not weight.is_contiguous(), name
        assert torch.equal(weight, reference_weights[name + ".weight"]), name
    token_ids = torch.tensor([[1, 5, 9, 13, 7, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(token_ids).logits, reference(token_ids).logits, rtol=1e-5, atol=1e-5)


def test_a_tied_lm_head_gets_its_own_copy_and_the_embeddings_stay_row_major(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(ModelConfig(model=str(tmp_path), device="cpu")).model
    embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embeddings.is_contiguous() and head.t().is_contiguous()
    assert head.data_ptr() != embeddings.data_ptr() and torch.equal(head, embeddings)
