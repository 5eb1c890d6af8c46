"""The single-process reference's validation loss: the score ``bench/val_parity.py`` compares the swarm against."""

import math

import pytest

from swarm.reference import reference_validation_loss, train_reference


def test_reference_validation_loss_is_the_sample_weighted_mean_and_falls_with_training(tiny_spec, tiny_dataset):
    spec = tiny_spec.updated(training={"precision": "fp32"})
    untrained = train_reference(spec, tiny_dataset, max_samples=0)
    n = 13
    whole = reference_validation_loss(untrained.stages, tiny_dataset, max_samples=n, batch_size=n)
    one_by_one = reference_validation_loss(untrained.stages, tiny_dataset, max_samples=n, batch_size=1)
    assert whole == pytest.approx(one_by_one, rel=1e-5), "the mean of the samples' own losses"
    assert reference_validation_loss(untrained.stages, tiny_dataset, max_samples=n, batch_size=5) == \
        pytest.approx(whole, rel=1e-5), "batches of 5, 5 and 3 samples weigh each sample once"
    assert abs(whole - math.log(spec.model.vocab_size)) < 1.0, "an untrained model scores about ln(vocab)"
    trained = train_reference(spec, tiny_dataset, max_samples=4 * spec.training.target_batch_size)
    assert reference_validation_loss(trained.stages, tiny_dataset, max_samples=64) < \
        reference_validation_loss(untrained.stages, tiny_dataset, max_samples=64) - 0.2
    with pytest.raises(ValueError, match="holds no sample"):
        reference_validation_loss(untrained.stages, tiny_dataset, max_samples=0)
