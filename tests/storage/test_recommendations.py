import numpy as np

from shardflow.errors import InputError
from storage import recommendations


def test_a_user_without_a_list_is_told_whose_lists_the_store_holds_and_from_which_model(tmp_path):
    """A night's lists cover the users of its new parts, ranked by the model current then (which may be an
    older version than the night's own)."""
    files = recommendations.write_part(tmp_path, 0, np.array(["u1", "u2"]), np.array([["a", "b"], ["c", ""]]),
                                       np.array([[2.0, 1.0], [3.0, 0.0]]))
    recommendations.finish(tmp_path, {"version": 1, "k": 2, "users_from": "window", "first_part": 1, "users": 2},
                           files)
    assert recommendations.find(tmp_path, "u2") == [("c", 3.0)] and recommendations.find(tmp_path, "u0") is None
    refused = recommendations.missing(tmp_path, "u0")
    assert isinstance(refused, InputError)
    assert str(refused) == (f"user 'u0': no list in {tmp_path} (it holds the 2 users seen from part 2 of the dataset "
                            "on, ranked by version 1); accepted: a raw user id of those users, as the dataset spells "
                            "it")


def test_only_a_sequence_model_without_event_features_writes_lists():
    assert recommendations.why_none({"kind": "sequence", "features": []}) is None
    assert recommendations.why_none({"features": []}) is None  # kept before click logs trained: a sequence model
    assert recommendations.why_none({"kind": "click", "features": []}).startswith("a click-log model")
    assert recommendations.why_none({"kind": "sequence", "features": ["genre"]}).startswith(
        "a model with event features ['genre']")
