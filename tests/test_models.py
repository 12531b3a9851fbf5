"""common.models: shapes, parameter counts from the papers' layer tables, scaling, init, and the LSTM state API."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from common.models import make_ddpg_model, make_model, make_q_network

FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
FLAT = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)


def conv(cin, cout, k):
    return cin * cout * k * k + cout


def linear(fin, fout):
    return fin * fout + fout


def expected_params(network, num_actions, obs_dim=4, lstm=0):
    """Counted by hand from the layer tables (Mnih et al. 2015; Espeholt et al. 2018 Fig. 3; CleanRL's MLP agent)."""
    if network == "nature":
        # 84 -> 20 -> 9 -> 7 spatial; 64 * 7 * 7 = 3136 inputs to fc 512
        torso = conv(4, 32, 8) + conv(32, 64, 4) + conv(64, 64, 3) + linear(3136, 512)
        features = 512
    elif network == "impala":
        torso, cin = 0, 4
        for c in (16, 32, 32):  # conv + 2 residual blocks of 2 convs each; 84 -> 42 -> 21 -> 11 spatial
            torso += conv(cin, c, 3) + 4 * conv(c, c, 3)
            cin = c
        torso += linear(32 * 11 * 11, 256)
        features = 256
    else:  # separate 64-64 policy and value towers
        return (linear(obs_dim, 64) + linear(64, 64)) * 2 + linear(64, num_actions) + linear(64, 1)
    core = 0
    if lstm:  # one layer: 4 gates, input and hidden weights, two bias vectors
        core = 4 * lstm * (features + lstm) + 2 * 4 * lstm
        features = lstm
    return torso + core + linear(features, num_actions) + linear(features, 1)


@pytest.mark.parametrize("network", ["nature", "impala"])
@pytest.mark.parametrize("use_lstm", [False, True])
def test_image_networks_shapes_and_parameter_counts(network, use_lstm):
    model = make_model(FRAMES, gym.spaces.Discrete(6), network, use_lstm=use_lstm)
    assert sum(p.numel() for p in model.parameters()) == expected_params(network, 6, lstm=256 if use_lstm else 0)
    obs = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    if use_lstm:
        logits, value, (h, c) = model.recurrent(obs.view(1, 5, 4, 84, 84), torch.zeros(1, 5), model.initial_state(5))
        assert logits.shape == (1, 5, 6) and value.shape == (1, 5) and h.shape == c.shape == (1, 5, 256)
    else:
        logits, value = model(obs)
        assert logits.shape == (5, 6) and value.shape == (5,)


def test_known_totals():
    """Totals quoted elsewhere: Nature A2C with 4 actions, CleanRL's CartPole agent."""
    assert sum(p.numel() for p in make_model(FRAMES, gym.spaces.Discrete(4), "nature").parameters()) == 1_686_693
    assert sum(p.numel() for p in make_model(FLAT, gym.spaces.Discrete(2)).parameters()) == 9_155


def test_auto_picks_network_from_observation_space():
    assert type(make_model(FRAMES, gym.spaces.Discrete(4)).torso).__name__ == "NatureCNN"
    mlp = make_model(FLAT, gym.spaces.Discrete(2))
    assert sum(p.numel() for p in mlp.parameters()) == expected_params("mlp", 2)
    logits, value = mlp(torch.zeros(3, 4))
    assert logits.shape == (3, 2) and value.shape == (3,)


@pytest.mark.parametrize("network", ["nature", "impala"])
def test_uint8_frames_are_scaled_inside(network):
    torch.manual_seed(0)
    model = make_model(FRAMES, gym.spaces.Discrete(4), network)
    obs = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    logits, value = model(obs)
    with torch.no_grad():
        h = model.torso((obs.double() / 255.0).float())
        np.testing.assert_allclose(logits.detach(), model.policy(h), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(value.detach(), model.value(h).squeeze(-1), rtol=1e-4, atol=1e-5)


def test_orthogonal_init_gains_and_zero_biases():
    model = make_model(FRAMES, gym.spaces.Discrete(6), "nature")
    head = model.policy[-1].weight.detach()  # [6, 512], rows orthogonal with norm 0.01
    np.testing.assert_allclose(head @ head.T, 0.01**2 * torch.eye(6), atol=1e-7)
    value = model.value[-1].weight.detach()
    assert value.norm().item() == pytest.approx(1.0, rel=1e-5)
    conv1 = model.torso.convs[0].weight.detach().reshape(32, -1)  # [32, 256]: rows orthogonal with norm sqrt(2)
    np.testing.assert_allclose(conv1 @ conv1.T, 2 * torch.eye(32), atol=1e-4)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name


def test_lstm_state_resets_where_episodes_start():
    torch.manual_seed(0)
    model = make_model(FRAMES, gym.spaces.Discrete(4), "nature", use_lstm=True, lstm_size=32)
    T, B = 6, 2
    obs = torch.randint(0, 256, (T, B, 4, 84, 84), dtype=torch.uint8)
    done = torch.zeros(T, B)
    done[3, 0] = 1  # obs[3, 0] begins a new episode
    state = tuple(torch.randn_like(s) for s in model.initial_state(B))  # some state carried from earlier
    with torch.no_grad():
        logits, value, _ = model.recurrent(obs, done, state)
        # Reference for env 0 after the reset: a fresh zero state fed steps 3..5 one at a time.
        h = c = torch.zeros(1, 1, 32)
        for t in range(3, T):
            x = model.features(obs[t, :1])
            out, (h, c) = model.core(x.unsqueeze(0), (h, c))
            np.testing.assert_allclose(logits[t, 0], model.policy(out[0, 0]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(value[t, 0], model.value(out[0, 0])[0], rtol=1e-5, atol=1e-6)
        # Env 1 never resets: its output depends on the carried state.
        fresh, _, _ = model.recurrent(obs[:, 1:], done[:, 1:], model.initial_state(1))
        assert not torch.allclose(fresh[-1, 0], logits[-1, 1])


def test_lstm_unroll_equals_chained_single_steps():
    torch.manual_seed(1)
    model = make_model(FLAT, gym.spaces.Discrete(2), "mlp", use_lstm=True, lstm_size=16)
    T, B = 5, 3
    obs, done = torch.randn(T, B, 4), (torch.rand(T, B) < 0.3).float()
    with torch.no_grad():
        logits, value, final = model.recurrent(obs, done, model.initial_state(B))
        state = model.initial_state(B)
        for t in range(T):
            step_logits, step_value, state = model.recurrent(obs[t : t + 1], done[t : t + 1], state)
            np.testing.assert_allclose(step_logits[0], logits[t], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(step_value[0], value[t], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state[0], final[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="recurrent"):
        model(obs[0])


def test_lstm_core_gets_contiguous_state_from_a_strided_batch():
    """IMPALA's learner batch holds the LSTM state as a transposed view ([K, L, N, H] -> [L, K*N, H]); cuDNN's LSTM
    raises "rnn: hx is not contiguous" on such a state where the CPU LSTM accepts it, so the check is on what the
    core receives."""
    model = make_model(FLAT, gym.spaces.Discrete(2), "mlp", use_lstm=True, lstm_size=16, lstm_layers=2)
    K, N, T, L = 2, 1, 4, 2  # one env per actor (the default) and two layers: a strided view, no copy
    stored = torch.randn(K, L, N, 16)  # as impala_monobeast.py's buffers keep initial_h / initial_c
    state = tuple(s.transpose(0, 1).flatten(1, 2) for s in (stored, stored.clone()))
    assert not state[0].is_contiguous()
    seen = []
    model.core.register_forward_pre_hook(lambda m, a: seen.append([s.is_contiguous() for s in a[1]]))
    with torch.no_grad():
        model.recurrent(torch.randn(T, K * N, 4), torch.zeros(T, K * N), state)
    assert seen and all(all(flags) for flags in seen), seen


def test_bad_network_choices():
    with pytest.raises(ValueError, match="--network must be one of"):
        make_model(FRAMES, gym.spaces.Discrete(4), "resnet50")
    with pytest.raises(ValueError, match="image observations"):
        make_model(FLAT, gym.spaces.Discrete(2), "impala")
    with pytest.raises(ValueError, match="Discrete"):
        make_model(FLAT, gym.spaces.Box(-1, 1, (2,)), "mlp")


@pytest.mark.parametrize("network", ["nature", "impala"])
def test_memory_format_does_not_change_the_function(network):
    torch.manual_seed(3)
    fast = make_model(FRAMES, gym.spaces.Discrete(4), network)
    plain = make_model(FRAMES, gym.spaces.Discrete(4), network, channels_last=False)
    plain.load_state_dict(fast.state_dict())
    obs = torch.randint(0, 256, (4, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        for a, b in zip(fast(obs), plain(obs), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ Ape-X networks: dueling Q and DDPG


@pytest.mark.parametrize(("network", "space"), [("nature", FRAMES), ("impala", FRAMES), ("mlp", FLAT)])
def test_dueling_q_network_shapes_and_aggregation(network, space):
    """Q = V + A - mean_a A (Wang et al. 2016, Eq. 9), checked against the two streams computed by hand."""
    torch.manual_seed(0)
    model = make_q_network(space, gym.spaces.Discrete(5), network)
    obs = torch.randint(0, 256, (3, *space.shape), dtype=torch.uint8) if network != "mlp" else torch.randn(3, 4)
    with torch.no_grad():
        q = model(obs)
        h = model.features(obs)
        value, advantage = model.value(h), model.advantage(h)  # [3, 1], [3, 5]
    assert q.shape == (3, 5) and value.shape == (3, 1) and advantage.shape == (3, 5)
    by_hand = [[value[b, 0] + advantage[b, a] - sum(advantage[b]) / 5 for a in range(5)] for b in range(3)]
    np.testing.assert_allclose(q, torch.tensor(by_hand), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(q.mean(1), value[:, 0], rtol=1e-5, atol=1e-5)  # advantages average to 0


def test_dueling_nature_parameter_count():
    """Nature convolutions, then value and advantage streams of fc 512 each (Wang et al. 2016, Section 4.2)."""
    model = make_q_network(FRAMES, gym.spaces.Discrete(6), "nature")
    convs = conv(4, 32, 8) + conv(32, 64, 4) + conv(64, 64, 3)
    streams = linear(3136, 512) + linear(512, 1) + linear(3136, 512) + linear(512, 6)
    assert sum(p.numel() for p in model.parameters()) == convs + streams
    mlp = make_q_network(FLAT, gym.spaces.Discrete(2), "mlp", hidden=(64, 32))
    assert sum(p.numel() for p in mlp.parameters()) == linear(4, 64) + linear(64, 32) + linear(32, 1) + linear(32, 2)


def test_ddpg_actor_respects_bounds_and_critic_takes_actions():
    torch.manual_seed(0)
    actions = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32))
    model = make_ddpg_model(gym.spaces.Box(-np.inf, np.inf, (3,), np.float32), actions, hidden=(16, 16))
    obs = torch.randn(7, 3) * 100  # large inputs saturate the tanh: actions at the bounds, never past them
    with torch.no_grad():
        a = model(obs)
        assert a.shape == (7, 2)
        assert (a[:, 0] >= -2).all() and (a[:, 0] <= 2).all() and (a[:, 1] >= 0).all() and (a[:, 1] <= 1).all()
        pre = torch.tanh(model.actor(obs))  # the scaling by hand: low + (tanh + 1) (high - low) / 2
        np.testing.assert_allclose(a, torch.stack([pre[:, 0] * 2, (pre[:, 1] + 1) / 2], 1), rtol=1e-5, atol=1e-6)
        q = model.q(obs, a)
        assert q.shape == (7,)
        # Q(s, a) by hand from the critic's weights, observation columns first, then the action's (Section 7):
        # three ReLU layers written out as matrix products
        (w1, b1), (w2, b2), (w3, b3) = ((m.weight, m.bias) for m in model.critic if isinstance(m, nn.Linear))
        h = torch.relu(obs @ w1[:, :3].T + a @ w1[:, 3:].T + b1)
        np.testing.assert_allclose(q, (torch.relu(h @ w2.T + b2) @ w3.T + b3)[:, 0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(model.q(obs, torch.zeros_like(a)), q)  # the action reaches Q


def test_ape_x_networks_reject_wrong_spaces():
    with pytest.raises(ValueError, match="Discrete"):
        make_q_network(FLAT, gym.spaces.Box(-1, 1, (2,)))
    with pytest.raises(ValueError, match="image observations"):
        make_q_network(FLAT, gym.spaces.Discrete(2), "nature")
    with pytest.raises(ValueError, match="Box action space"):
        make_ddpg_model(FLAT, gym.spaces.Discrete(2))
    with pytest.raises(ValueError, match="finite action bounds"):
        make_ddpg_model(FLAT, gym.spaces.Box(-np.inf, np.inf, (2,)))


def test_action_reward_inputs_reach_the_heads_in_torchbeasts_order():
    """TorchBeast's AtariNet: head input = [torso features, clip(reward, -1, 1), one_hot(last_action)]. The mlp torso
    is a Flatten, so the whole vector is known by hand."""
    model = make_model(FLAT, gym.spaces.Discrete(3), "mlp", action_reward_inputs=True)
    seen = []
    model.policy[0].register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].clone()))
    obs = torch.tensor([[0.5, -1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    model(obs, last_action=torch.tensor([2, 0]), reward=torch.tensor([5.0, -0.3]))
    want = torch.tensor([[0.5, -1.0, 2.0, 3.0, 1.0, 0, 0, 1], [1.0, 1.0, 1.0, 1.0, -0.3, 1, 0, 0]])
    torch.testing.assert_close(seen[0], want)
    with pytest.raises(ValueError, match="last_action"):
        model(obs)


def test_action_reward_inputs_drive_the_outputs_of_a_hand_set_head():
    """Nature network: heads zeroed except the one-hot block (policy) and the reward entry (value), so the outputs are
    exactly one_hot(last_action) and the clipped reward, whatever the frames."""
    A = 6
    model = make_model(FRAMES, gym.spaces.Discrete(A), "nature", action_reward_inputs=True)
    policy, value = model.policy[-1], model.value[-1]
    assert policy.in_features == value.in_features == 512 + 1 + A
    with torch.no_grad():
        for layer in (policy, value):
            layer.weight.zero_(), layer.bias.zero_()
        policy.weight[:, 513:] = torch.eye(A)
        value.weight[0, 512] = 1.0
    obs = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    logits, v = model(obs, last_action=torch.tensor([5, 0, 3]), reward=torch.tensor([-7.0, 0.25, 30.0]))
    torch.testing.assert_close(logits, torch.eye(A)[[5, 0, 3]])
    torch.testing.assert_close(v, torch.tensor([-1.0, 0.25, 1.0]))


def test_torchbeast_lstm_core_is_sized_to_its_input():
    """lstm_size=0, 2 layers: AtariNet's nn.LSTM(512 + A + 1, 512 + A + 1, 2), fed [features, reward, one-hot]."""
    A, T, B = 4, 3, 2
    model = make_model(FRAMES, gym.spaces.Discrete(A), "nature", use_lstm=True, lstm_size=0, lstm_layers=2,
                       action_reward_inputs=True)  # fmt: skip
    assert (model.core.input_size, model.core.hidden_size, model.core.num_layers) == (517, 517, 2)
    assert model.policy[-1].in_features == 517
    seen = []
    model.core.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].clone()))
    obs = torch.randint(0, 256, (T, B, 4, 84, 84), dtype=torch.uint8)
    last_action, reward = torch.tensor([[1, 3], [0, 2], [3, 3]]), torch.tensor([[0.0, 2.0], [-4.0, 0.5], [1.0, 0.0]])
    with torch.no_grad():
        logits, value, state = model.recurrent(obs, torch.zeros(T, B), model.initial_state(B), last_action, reward)
        for t in range(T):
            features = model.features(obs[t])
            want = torch.cat([features, reward[t].clamp(-1, 1)[:, None], torch.eye(A)[last_action[t]]], dim=1)
            torch.testing.assert_close(seen[t][0], want)
    assert logits.shape == (T, B, A) and value.shape == (T, B) and state[0].shape == (2, B, 517)
