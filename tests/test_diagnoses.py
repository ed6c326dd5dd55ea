"""gst.diagnoses: what a wrong factor means, worded once for verify_gradients and the exercises."""

import torch

from gradsync_tutorial import diagnoses
from gradsync_tutorial._verify_report import name_factor
from gradsync_tutorial.exercises import evidence


def test_each_size_of_a_job_has_its_meaning_and_other_factors_have_none():
    assert diagnoses.meaning(2.0, world_size=2) == (
        "summed, not divided by the world size (notebook 02)")
    assert diagnoses.meaning(0.5, world_size=2) == "divided by the world size twice"
    assert diagnoses.meaning(3.0, world_size=2, micro=3).startswith(
        "not divided by the micro-batches")
    assert diagnoses.meaning(1.5, world_size=2, micro=3) is None
    assert diagnoses.meaning(2.0) is None  # one rank, one micro-batch: no size is 2


def test_verify_gradients_and_the_exercise_checks_say_the_same_words():
    expected = {"w": torch.tensor([1.0, -2.0, 0.5])}
    for c, n in ((2.0, 2), (0.5, 2), (1 / 3, 3)):
        got = {"w": c * expected["w"]}
        words = diagnoses.meaning(c, world_size=n)
        exercise = evidence.mean_mismatch(got, expected, n, "the mean over ranks",
                                          "divide the sum by the world size.")
        verify = name_factor(c, world_size=n, micro=1, sizes={}, tol=1e-6)
        assert words and words in exercise and verify.endswith(words), (exercise, verify)
    accumulated = evidence.mean_mismatch({"w": 3 * expected["w"]}, expected, 3, "the mean",
                                         "divide by the micro-batches.",
                                         divisor="micro_batches")
    assert diagnoses.meaning(3.0, micro=3) in accumulated
