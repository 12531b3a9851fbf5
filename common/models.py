"""The networks of the seed papers: actor-critics returning policy logits and a state value, and Q-networks.

- `nature`: the "shallow" Nature/A2C network, conv 32x8x8/4, 64x4x4/2, 64x3x3/1, fc 512 (Mnih et al. 2015;
  GALA Table 2; HTS-RL Appendix F.1; TorchBeast's shallow net).
- `impala`: the IMPALA "deep" ResNet, three sections of conv 3x3 + max-pool 3x3/2 + two residual blocks with
  16/32/32 channels, then fc 256 (Espeholt et al. 2018, Figure 3; Cleanba's default network).
- `mlp`: for flat observations, separate policy and value towers of 2x64 tanh (CleanRL's classic-control agent).
- Optional LSTM core (`use_lstm`) between torso and heads, with an explicit recurrent-state API (IMPALA, TorchBeast).
- Optional TorchBeast inputs (`action_reward_inputs`): the core (LSTM, or the heads directly) takes the torso features,
  the reward that arrived with the observation clipped to [-1, 1], and a one-hot of the last action, concatenated in
  that order, as TorchBeast's `AtariNet` does. Off by default, so models and checkpoints without it are unchanged.
- Ape-X (`make_q_network`, `make_ddpg_model`): a dueling Q-network on the same torsos, and a deterministic actor with
  a Q(s, a) critic for continuous actions (DDPG).

uint8 frames are scaled to [0, 1] inside the model, so actors ship uint8 observations. Initialisation follows the
reference A2C/PPO code (baselines, CleanRL): orthogonal weights with gain sqrt(2) for hidden layers, 0.01 for the
policy head, 1 for the value head, zero biases; the IMPALA ResNet's convolutions keep PyTorch's default init, as in
CleanRL's IMPALA-CNN. Image networks run in `channels_last` memory format by default: oneDNN trained both faster
that way on this project's CPU (interleaved A/B runs during development; the IMPALA ResNet gains most), while the
Nature network's small-batch inference was slightly slower, so an actor-only copy may pass `channels_last=False`.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn

NETWORKS = ("auto", "nature", "impala", "mlp")
LSTMState = tuple[torch.Tensor, torch.Tensor]  # (h, c), each [num_layers, B, hidden]


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """Orthogonal weights with gain `std`, constant bias (baselines' `ortho_init`)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


def _conv_out(torso: nn.Module, shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return torso(torch.zeros(1, *shape)).shape[1]


class NatureCNN(nn.Module):
    """Nature DQN / A2C torso: [B, C, 84, 84] uint8 -> [B, 512]."""

    def __init__(self, in_shape: tuple[int, int, int]):
        super().__init__()
        self.convs = nn.Sequential(
            layer_init(nn.Conv2d(in_shape[0], 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(layer_init(nn.Linear(_conv_out(self.convs, in_shape), 512)), nn.ReLU())
        self.out_features = 512

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convs(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImpalaResNet(nn.Module):
    """IMPALA deep torso: [B, C, 84, 84] uint8 -> [B, 256]; spatial 84 -> 42 -> 21 -> 11."""

    def __init__(self, in_shape: tuple[int, int, int], channels: tuple[int, ...] = (16, 32, 32), hidden: int = 256):
        super().__init__()
        layers, in_ch = [], in_shape[0]
        for out_ch in channels:
            layers += [
                nn.Conv2d(in_ch, out_ch, 3, padding=1),
                nn.MaxPool2d(3, stride=2, padding=1),
                ResidualBlock(out_ch),
                ResidualBlock(out_ch),
            ]
            in_ch = out_ch
        self.convs = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
        self.fc = nn.Sequential(layer_init(nn.Linear(_conv_out(self.convs, in_shape), hidden)), nn.ReLU())
        self.out_features = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convs(x))


def _mlp(in_features: int, hidden: tuple[int, ...], out_features: int, out_std: float) -> nn.Sequential:
    layers, size = [], in_features
    for h in hidden:
        layers += [layer_init(nn.Linear(size, h)), nn.Tanh()]
        size = h
    return nn.Sequential(*layers, layer_init(nn.Linear(size, out_features), std=out_std))


def _torso_input(obs: torch.Tensor, image: bool, channels_last: bool) -> torch.Tensor:
    """Observations as the torso takes them: floats, frames scaled to [0, 1], optionally channels_last."""
    if channels_last:
        obs = obs.contiguous(memory_format=torch.channels_last)  # cheaper on uint8 than on floats
    x = obs.float()
    if image:
        x = x.div_(255.0) if x is not obs else x / 255.0
    return x


class ActorCritic(nn.Module):
    """torso -> (optional LSTM core) -> policy logits and value.

    Feed-forward: `logits, value = model(obs)` with obs [B, ...] -> [B, A], [B].
    Recurrent: `logits, value, state = model.recurrent(obs, done, state)` with obs [T, B, ...] and done [T, B]
    (`done[t]` marks obs[t] as the first of a new episode: the state is zeroed before step t), returning
    [T, B, A], [T, B] and the state after step T-1. `model.initial_state(B)` gives zeros.
    With `action_reward_inputs`, both also take `last_action` (int64) and `reward` (raw; clipped here), shaped like
    `done`: the action taken before obs and the reward that arrived with obs.
    """

    def __init__(
        self,
        torso: nn.Module,
        torso_features: int,
        num_actions: int,
        *,
        head_hidden: tuple[int, ...] = (),
        use_lstm: bool = False,
        lstm_size: int = 256,
        lstm_layers: int = 1,
        action_reward_inputs: bool = False,
        image: bool = False,
        channels_last: bool = False,
    ):
        super().__init__()
        self.torso, self.image, self.channels_last, self.num_actions = torso, image, channels_last, num_actions
        self.action_reward_inputs = action_reward_inputs
        core_inputs = torso_features + (1 + num_actions if action_reward_inputs else 0)
        lstm_size = lstm_size or core_inputs  # 0: as wide as its input (TorchBeast's AtariNet)
        self.core = nn.LSTM(core_inputs, lstm_size, lstm_layers) if use_lstm else None
        if self.core is not None:
            for name, param in self.core.named_parameters():
                if "weight" in name:
                    nn.init.orthogonal_(param, 1.0)
                else:
                    nn.init.constant_(param, 0.0)
        features = lstm_size if use_lstm else core_inputs
        self.policy = _mlp(features, head_hidden, num_actions, out_std=0.01)
        self.value = _mlp(features, head_hidden, 1, out_std=1.0)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """[B, ...] observations (uint8 frames or floats) -> [B, F] torso features."""
        return self.torso(_torso_input(obs, self.image, self.channels_last))

    def core_input(self, obs: torch.Tensor, last_action=None, reward=None) -> torch.Tensor:
        """[B, ...] observations -> [B, F] input of the core: torso features, then (with `action_reward_inputs`)
        the clipped reward and the one-hot last action, TorchBeast's order."""
        x = self.features(obs)
        if not self.action_reward_inputs:
            return x
        if last_action is None or reward is None:
            raise ValueError("this model takes the last action and reward: pass last_action= and reward=")
        clipped = reward.reshape(-1, 1).to(x.dtype).clamp(-1.0, 1.0)
        one_hot = nn.functional.one_hot(last_action.reshape(-1).long(), self.num_actions).to(x.dtype)
        return torch.cat([x, clipped, one_hot], dim=-1)

    def forward(self, obs: torch.Tensor, last_action=None, reward=None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.core is not None:
            raise RuntimeError("this model has an LSTM core: call model.recurrent(obs, done, state)")
        h = self.core_input(obs, last_action, reward)
        return self.policy(h), self.value(h).squeeze(-1)

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu") -> LSTMState:
        assert self.core is not None, "initial_state() needs use_lstm=True"
        zeros = torch.zeros(self.core.num_layers, batch_size, self.core.hidden_size, device=device)
        return zeros, zeros.clone()

    def recurrent(self, obs: torch.Tensor, done: torch.Tensor, state: LSTMState, last_action=None, reward=None):
        assert self.core is not None, "recurrent() needs use_lstm=True"
        T, B = done.shape
        x = self.core_input(obs.reshape(T * B, *obs.shape[2:]), last_action, reward).reshape(T, B, -1)
        keep = (~done.bool()).float().unsqueeze(-1)  # [T, B, 1]
        outputs = []
        h, c = (s.contiguous() for s in state)  # cuDNN's LSTM refuses a strided state (e.g. a transposed batch view)
        for t in range(T):  # zero the state where an episode starts, then one LSTM step
            h, c = h * keep[t], c * keep[t]
            out, (h, c) = self.core(x[t : t + 1], (h, c))
            outputs.append(out)
        y = torch.cat(outputs).reshape(T * B, -1)
        return self.policy(y).reshape(T, B, -1), self.value(y).reshape(T, B), (h, c)


def _pick_network(network: str, observation_space: gym.Space, action_space: gym.Space, what: str):
    """Check the choice against the spaces; `auto` is `nature` for [C, H, W] frames, `mlp` for vectors."""
    if network not in NETWORKS:
        raise ValueError(f"--network must be one of {', '.join(NETWORKS)}, got {network!r}")
    if not isinstance(action_space, gym.spaces.Discrete):
        raise ValueError(
            f"{what} need{'s' if what.startswith('a ') else ''} a Discrete action space, got {action_space}"
        )
    shape = tuple(observation_space.shape)
    is_image = len(shape) == 3
    if network == "auto":
        network = "nature" if is_image else "mlp"
    if network in ("nature", "impala") and not is_image:
        raise ValueError(f"--network {network} needs [C, H, W] image observations, got shape {shape}")
    return network, shape


def make_model(
    observation_space: gym.Space,
    action_space: gym.Space,
    network: str = "auto",
    *,
    use_lstm: bool = False,
    lstm_size: int = 256,
    lstm_layers: int = 1,
    action_reward_inputs: bool = False,
    channels_last: bool = True,
) -> ActorCritic:
    """Pick the network from the observation space: `auto` is `nature` for [C, H, W] frames, `mlp` for vectors.

    `lstm_size=0` makes the LSTM as wide as its input; `action_reward_inputs` adds TorchBeast's inputs (see
    `ActorCritic`). TorchBeast's AtariNet: `nature`, `action_reward_inputs=True`, LSTM `lstm_size=0, lstm_layers=2`.
    """
    network, shape = _pick_network(network, observation_space, action_space, "these actor-critics")
    num_actions = int(action_space.n)
    core = dict(
        use_lstm=use_lstm, lstm_size=lstm_size, lstm_layers=lstm_layers, action_reward_inputs=action_reward_inputs
    )
    if network == "mlp":
        return ActorCritic(nn.Flatten(), math.prod(shape), num_actions, head_hidden=(64, 64), **core)
    torso = NatureCNN(shape) if network == "nature" else ImpalaResNet(shape)
    model = ActorCritic(torso, torso.out_features, num_actions, image=True, channels_last=channels_last, **core)
    return model.to(memory_format=torch.channels_last) if channels_last else model


# ----------------------------------------------------------------------------------------------------------------
# Value-based and deterministic-policy networks (Ape-X DQN and Ape-X DDPG)
# ----------------------------------------------------------------------------------------------------------------


def _relu_mlp(in_features: int, hidden: tuple[int, ...], out_features: int, out_std: float = 1.0) -> nn.Sequential:
    layers, size = [], in_features
    for h in hidden:
        layers += [layer_init(nn.Linear(size, h)), nn.ReLU()]
        size = h
    return nn.Sequential(*layers, layer_init(nn.Linear(size, out_features), std=out_std))


class DuelingQNetwork(nn.Module):
    """Dueling Q-network (Wang et al. 2016, Eq. 9; the network of Ape-X DQN): a shared torso, then a value stream and
    an advantage stream, Q(s, a) = V(s) + A(s, a) - mean_a' A(s, a'). `q = model(obs)`: [B, ...] -> [B, A].

    Frames: the torso is the convolutions of the Nature (or IMPALA) network and each stream has its own hidden fc
    layer (512 for Nature, as in Wang et al.); vectors: an MLP torso of ReLU layers and linear streams."""

    def __init__(
        self,
        torso: nn.Module,
        torso_features: int,
        num_actions: int,
        stream_hidden: tuple[int, ...],
        *,
        image: bool = False,
        channels_last: bool = False,
    ):
        super().__init__()
        self.torso, self.image, self.channels_last, self.num_actions = torso, image, channels_last, num_actions
        self.value = _relu_mlp(torso_features, stream_hidden, 1)
        self.advantage = _relu_mlp(torso_features, stream_hidden, num_actions)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        return self.torso(_torso_input(obs, self.image, self.channels_last))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        h = self.features(obs)
        advantage = self.advantage(h)  # [B, A]
        return self.value(h) + advantage - advantage.mean(dim=1, keepdim=True)  # [B, 1] + [B, A] -> [B, A]


def make_q_network(
    observation_space: gym.Space,
    action_space: gym.Space,
    network: str = "auto",
    *,
    hidden: tuple[int, ...] = (256, 256),
    channels_last: bool = True,
) -> DuelingQNetwork:
    """A dueling Q-network for a Discrete action space: `nature`/`impala` convolutions for [C, H, W] frames (`auto`
    picks `nature`), or an MLP torso with `hidden` ReLU layers for flat observations (`mlp`)."""
    network, shape = _pick_network(network, observation_space, action_space, "a Q-network")
    num_actions = int(action_space.n)
    if network == "mlp":
        torso = nn.Sequential(nn.Flatten(), _relu_mlp(math.prod(shape), hidden[:-1], hidden[-1]), nn.ReLU())
        return DuelingQNetwork(torso, hidden[-1], num_actions, ())
    convs = (NatureCNN(shape) if network == "nature" else ImpalaResNet(shape)).convs
    stream = 512 if network == "nature" else 256
    model = DuelingQNetwork(
        convs, _conv_out(convs, shape), num_actions, (stream,), image=True, channels_last=channels_last
    )
    return model.to(memory_format=torch.channels_last) if channels_last else model


class DeterministicActorCritic(nn.Module):
    """DDPG's two networks (Lillicrap et al. 2016, Section 7): a deterministic actor mu(s), tanh-squashed and scaled
    to the Box bounds, and a critic Q(s, a) on the concatenated observation and action, both ReLU MLPs.
    `action = model(obs)` is the actor: [B, obs_dim] -> [B, act_dim]; `model.q(obs, action)` -> [B]."""

    def __init__(self, obs_dim: int, action_low, action_high, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        low = torch.as_tensor(action_low, dtype=torch.float32)
        high = torch.as_tensor(action_high, dtype=torch.float32)
        act_dim = low.numel()
        # last layers small (Lillicrap et al. use U[-3e-3, 3e-3]): initial actions near the middle, Q near 0
        self.actor = _relu_mlp(obs_dim, hidden, act_dim, out_std=0.01)
        self.critic = _relu_mlp(obs_dim + act_dim, hidden, 1, out_std=0.01)
        self.register_buffer("action_scale", (high - low) / 2)
        self.register_buffer("action_bias", (high + low) / 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.actor(obs.float())) * self.action_scale + self.action_bias

    def q(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.critic(torch.cat([obs.float(), action], dim=-1)).squeeze(-1)


def make_ddpg_model(
    observation_space: gym.Space, action_space: gym.Space, hidden: tuple[int, ...] = (256, 256)
) -> DeterministicActorCritic:
    """Actor and critic for flat observations and a bounded Box action space."""
    if not isinstance(action_space, gym.spaces.Box) or len(action_space.shape) != 1:
        raise ValueError(f"DDPG needs a 1-D Box action space, got {action_space}")
    if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
        raise ValueError(f"DDPG needs finite action bounds, got {action_space}")
    if len(observation_space.shape) != 1:
        raise ValueError(f"DDPG here needs flat observations, got shape {observation_space.shape}")
    return DeterministicActorCritic(int(observation_space.shape[0]), action_space.low, action_space.high, hidden)
