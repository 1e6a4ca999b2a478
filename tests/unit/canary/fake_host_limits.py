"""The capacities of the canary tests' fake host, shared by its conftest and the tests that build
inputs against them (a module of its own: `conftest` names a different module in each test folder)."""

import torch

MAX_ROWS, MAX_CONTEXT, MAX_TOKENS = 8, 32, 32
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
