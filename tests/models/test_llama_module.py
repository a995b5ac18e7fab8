"""`jaxpaged.models.llama` as a Flax NNX module: its state is the loaders' layout, stacked on a layer axis, and
parameters that do not fit the config are refused with the tensor's name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpaged.loader.layout import expected_shapes
from jaxpaged.models import families, llama
from tests.tiny import random_params, tiny_config


@pytest.mark.parametrize("kw", [{}, {"attention_bias": True}, {"qk_norm": True, "tie_word_embeddings": True}],
                         ids=["llama", "qwen2", "qwen3-tied"])
def test_module_state_is_the_loader_layout_with_layers_stacked(kw):
    config = tiny_config(layers=3, **kw)
    _, state = nnx.split(llama.LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(state))
    assert shapes == expected_shapes(config)
    assert all(s[0] == 3 for s in jax.tree.leaves(shapes["layers"], is_leaf=lambda x: isinstance(x, tuple)))


def test_from_params_names_what_does_not_fit():
    config = tiny_config()
    params = random_params(config)
    model = families.from_params(config, params)
    np.testing.assert_array_equal(np.asarray(model.layers.wq[...]), params["layers"]["wq"])
    del params["layers"]["w_up"]
    with pytest.raises(ValueError, match=r"params/layers: missing \['w_up'\]"):
        families.from_params(config, params)
    params = random_params(config)
    params["embed"] = params["embed"][:, :-1]
    with pytest.raises(ValueError, match=r"params/embed has shape \(96, 31\), expected \(96, 32\)"):
        families.from_params(config, params)
