import pytest
import torch

from nvalchemi_ase.models import (
    available_models,
    load_model,
    model_native_dtype,
    resolve_model,
)


def test_known_names():
    assert {"lj", "demo"} <= set(available_models())


def test_lj_parameters_reach_the_wrapper():
    model = load_model("LJ", epsilon=0.2, sigma=2.5, cutoff=6.0, switch_width=1.0)
    assert (model.epsilon, model.sigma, model.cutoff, model.switch_width) == (
        0.2,
        2.5,
        6.0,
        1.0,
    )
    assert model.model_config.neighbor_config.cutoff == 6.0
    assert model_native_dtype(model) is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"sigma": -1.0}, "sigma must be positive"),
        (
            {"cutoff": 5.0, "switch_width": 6.0},
            r"switch_width must be in \[0, cutoff=5.0\)",
        ),
    ],
)
def test_lj_rejects_bad_parameters(params, message):
    with pytest.raises(ValueError, match=message):
        load_model("lj", **params)


def test_unknown_parameter_is_a_type_error():
    with pytest.raises(TypeError, match="epsilom"):
        load_model("lj", epsilom=1.0)


def test_demo_weights_are_reproducible_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    first = load_model("demo", seed=3)
    second = load_model("demo", seed=3)
    other = load_model("demo", seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    weights = [next(m.parameters()) for m in (first, second, other)]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])
    assert model_native_dtype(first) == torch.float32


def test_resolve_model_passes_instances_through_and_rejects_params_with_them():
    model = load_model("lj")
    assert resolve_model(model) is model
    with pytest.raises(TypeError, match="only be given with a model name"):
        resolve_model(model, sigma=3.0)
