"""Opacus' DP-SGD on the digits task of `utility_task.py` (PyTorch, CPU, 2 threads):
`PrivacyEngine(accountant="rdp").make_private(..., noise_multiplier=1.1,
max_grad_norm=1.0, poisson_sampling=True)` on a DataLoader of batch 64: its DPDataLoader
samples Poisson batches at rate 1 / len(loader) = 1/22, and its DPOptimizer divides the
noisy sum by the expected batch size 64. The MLP's Linear layers are initialized as
Keras' Dense (Glorot uniform, zero bias). Epsilon from `privacy_engine.get_epsilon(1e-5)`
(Opacus' own RDP accountant); its PRV accountant's epsilon for the same steps is printed
beside it (`epsilon_other`).

Install (a virtualenv of its own):
    python3.11 -m venv /tmp/peers-torch && /tmp/peers-torch/bin/pip install torch==2.13.0 opacus==1.6.0 numpy scikit-learn
Run (from the project root; one JSON line per seed):
    /tmp/peers-torch/bin/python benchmarks/peers_utility/opacus_digits.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")
# Before torch loads libgomp: idle OpenMP threads sleep instead of spinning on a shared CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opacus  # noqa: E402
import torch  # noqa: E402
import utility_task as common  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(2)


def run(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    x, y, x_test, y_test = common.digits()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, common.HIDDEN), nn.ReLU(), nn.Linear(common.HIDDEN, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):  # as Keras' Dense: Glorot uniform, zero bias
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(data, batch_size=common.BATCH)
    engine = opacus.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=args.noise_multiplier,
        max_grad_norm=common.CLIP,
        poisson_sampling=True,
    )
    criterion = nn.CrossEntropyLoss()  # mean over the batch
    steps = 0
    start = time.perf_counter()
    for _ in range(args.epochs):
        for features, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(features), labels).backward()
            optimizer.step()
            steps += 1
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    accuracy = float((predicted == y_test).mean())
    epsilon = engine.get_epsilon(common.DELTA)
    prv = opacus.accountants.PRVAccountant()  # the same steps, its PRV accountant
    prv.history = list(engine.accountant.history)
    return dict(
        tool="Opacus",
        accuracy=accuracy,
        epsilon=epsilon,
        steps=steps,
        seconds=seconds,
        accountant="RDP (opacus PrivacyEngine)",
        epsilon_other=prv.get_epsilon(common.DELTA),
        other_accountant="PRV",
        sampling=f"Poisson (DPDataLoader, rate {loader.sample_rate:.6f})",
        expected_batch_size=optimizer.expected_batch_size,
        version=f"opacus {opacus.__version__}, torch {torch.__version__}",
    )


if __name__ == "__main__":
    common.main(__doc__.split("\n")[0], run)
