"""Device values read on the host later: in push order, with their tags, at most max_pending late."""

import torch

from litegen.instruments.readback import Readback


def test_values_come_back_in_order_with_their_tags_and_times():
    readback = Readback(torch.device("cpu"))
    readback.push(torch.tensor(1.5), "a")
    readback.push(torch.tensor([2.0, 3.0]), "b")
    arrived = list(readback.ready())
    assert [(tag, values) for tag, values, _ in arrived] == [("a", [1.5]), ("b", [2.0, 3.0])]
    assert readback.start_time <= arrived[0][2] <= arrived[1][2]
    assert list(readback.ready(wait=True)) == []  # each push is handed back once


def test_a_pushed_tensor_changed_afterwards_reads_as_it_was():
    readback = Readback(torch.device("cpu"))
    loss = torch.tensor(4.0)
    readback.push(loss, 7)
    loss.add_(1.0)
    assert [values for _, values, _ in readback.ready()] == [[4.0]]
