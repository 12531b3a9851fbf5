"""common.atari against real ALE ROMs and gymnasium envs, with ale-py's raw C++ env as the independent reference."""

import importlib

import numpy as np
import pytest
from ale_py.vector_env import AtariVectorEnv

from common.atari import EnvError, check_env_args, check_video, finished_episodes, make_env, make_vector_env


def raw_ale(game, num_envs, **kw):
    """The reference: ale-py's vector env with the deepmind frames but no clipping and no life-loss signal."""
    return AtariVectorEnv(
        game,
        num_envs,
        num_threads=1,
        autoreset_mode="SameStep",
        reward_clipping=False,
        episodic_life=False,
        life_loss_info=False,
        **kw,
    )


@pytest.mark.parametrize(
    ("protocol", "num_actions"),
    [("deepmind", 6), ("machado", 18)],  # Space Invaders: minimal set 6, full set 18
)
def test_ale_observations_and_actions(protocol, num_actions):
    envs = make_vector_env("ALE/SpaceInvaders-v5", 3, seed=1, protocol=protocol, num_threads=1)
    obs, info = envs.reset()
    assert obs.shape == (3, 4, 84, 84) and obs.dtype == np.uint8
    assert envs.single_observation_space.shape == (4, 84, 84)
    assert envs.single_action_space.n == num_actions
    obs, reward, terminated, truncated, info = envs.step(np.zeros(3, dtype=np.int64))
    assert obs.shape == (3, 4, 84, 84) and obs.dtype == np.uint8 and obs[:, -1].any()
    assert reward.dtype == np.float32 and terminated.dtype == np.bool_ and truncated.shape == (3,)
    envs.close()


def test_noop_starts_differ_by_seed_and_repeat_for_same_seed():
    def first_frames(seed):
        envs = make_vector_env("ALE/Breakout-v5", 2, seed=seed, num_threads=1)
        obs, _ = envs.reset()
        frames = [obs]
        rng = np.random.default_rng(0)
        for _ in range(30):
            frames.append(envs.step(rng.integers(0, 4, 2))[0])
        envs.close()
        return np.stack(frames)

    a, b, c = first_frames(7), first_frames(7), first_frames(8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_stepping_threads_change_no_frame_reward_or_end():
    """Scripts pick --env-threads from the machine (cleanba_ppo_impala.py: fewer beside a CPU learner); a run's data,
    and with it a reproducible run's bits, must not depend on it: 8 Breakout envs, 1 thread against 2."""

    def transitions(threads):
        envs = make_vector_env("ALE/Breakout-v5", 8, seed=3, num_threads=threads)
        steps = [envs.reset()[0]]
        rng = np.random.default_rng(0)
        for _ in range(600):  # past the first lost lives and a game over of some env under random play
            obs, reward, terminated, truncated, _ = envs.step(rng.integers(0, 4, 8))
            steps += [obs, reward, terminated, truncated]
        envs.close()
        return steps

    one, two = transitions(1), transitions(2)
    assert all(np.array_equal(x, y) for x, y in zip(one, two, strict=True))
    assert any(x.dtype == bool and x.any() for x in one)  # some env's life or game ended: the resets are compared too


def test_seeds_past_int32_fold_into_ale_range():
    # a resumed impala run seeds its actors with seed + 1_000_003 * updates: 1.2e11 after 120k updates
    envs = make_vector_env("ALE/Breakout-v5", 2, seed=1_000_003 * 120_000, num_threads=1)
    obs, _ = envs.reset()
    envs.close()
    ref = raw_ale("breakout", 2, noop_max=30, repeat_action_probability=0.0)
    ref_obs, _ = ref.reset(seed=np.arange(2) + 1_000_003 * 120_000 % (2**31 - 2))
    np.testing.assert_array_equal(obs, ref_obs)


def play_against_reference(
    protocol, game="space_invaders", env_id="ALE/SpaceInvaders-v5", seed=3, max_steps=5000, clip_rewards=True
):
    """Step the wrapped env and the raw reference with the same seed and actions until the first game over."""
    noop_max = 30 if protocol == "deepmind" else 1
    sticky = 0.0 if protocol == "deepmind" else 0.25
    ref = raw_ale(game, 1, noop_max=noop_max, repeat_action_probability=sticky, full_action_space=protocol == "machado")
    ref.reset(seed=seed)
    envs = make_vector_env(env_id, 1, seed=seed, protocol=protocol, num_threads=1, clip_rewards=clip_rewards)
    envs.reset()
    rng = np.random.default_rng(seed)
    raw_rewards, rewards, terminals, life_losses = [], [], 0, 0
    lives, since_loss = None, 99
    for _ in range(max_steps):
        action = rng.integers(0, envs.single_action_space.n, 1)
        r_obs, r_rew, r_term, r_trunc, r_info = ref.step(action)
        obs, rew, term, trunc, info = envs.step(action)
        if lives is not None and r_info["lives"][0] < lives and not (r_term[0] or r_trunc[0]):
            life_losses += 1
            since_loss = -1
        since_loss += 1
        if protocol == "deepmind" and since_loss < 3:  # frames from before a lost life are hidden
            r_obs = r_obs.copy()
            r_obs[0, : 3 - since_loss] = 0
        np.testing.assert_array_equal(obs, r_obs)  # otherwise the game underneath is untouched by the wrapper
        raw_rewards.append(float(r_rew[0]))
        rewards.append(float(rew[0]))
        terminals += int(term[0])
        lives = r_info["lives"][0]
        if r_term[0] or r_trunc[0]:
            return raw_rewards, rewards, terminals, life_losses, info
        assert not info["_episode"][0]
    raise AssertionError("the game did not end")


def test_deepmind_true_return_over_all_lives_and_clipping():
    raw_rewards, rewards, terminals, life_losses, info = play_against_reference("deepmind")
    assert max(raw_rewards) > 1, "Space Invaders rewards 5..30 per alien: clipping must matter"
    np.testing.assert_allclose(rewards, np.clip(raw_rewards, -1, 1))
    assert info["_episode"][0]
    assert info["episode"]["r"][0] == pytest.approx(sum(raw_rewards))  # unclipped, all lives
    assert info["episode"]["l"][0] == len(raw_rewards)
    assert life_losses >= 2  # Space Invaders starts with 3 lives
    assert terminals == life_losses + 1  # a terminal per lost life (game goes on), one at game over


@pytest.mark.parametrize("protocol", ["deepmind", "machado"])
def test_frame_stack_restarts_at_a_lost_life_under_deepmind(protocol):
    """deepmind: the observation that starts a new training episode after a lost life holds zeros plus the newest
    frame, and the next two hide the frames from before it, as after a new game; machado signals no life loss, so
    its frames stay the game's. The raw C++ env (same seed, same actions) gives the unmasked frames."""
    deepmind = protocol == "deepmind"
    kw = dict(noop_max=30 if deepmind else 1, repeat_action_probability=0.0 if deepmind else 0.25)
    ref = raw_ale("breakout", 2, full_action_space=not deepmind, **kw)
    ref.reset(seed=5)
    envs = make_vector_env("ALE/Breakout-v5", 2, seed=5, protocol=protocol, num_threads=1)
    envs.reset()
    rng = np.random.default_rng(5)
    lives, since_loss, checked = None, np.full(2, 99), 0
    for _ in range(3000):
        action = rng.integers(0, envs.single_action_space.n, 2)
        r_obs, _, r_term, r_trunc, r_info = ref.step(action)
        obs, _, term, _, _ = envs.step(action)
        lost = (r_info["lives"] < lives) & ~(r_term | r_trunc) if lives is not None else np.zeros(2, bool)
        lives = r_info["lives"]
        since_loss = np.where(lost, 0, since_loss + 1)
        for i in range(2):
            want = r_obs[i].copy()
            if deepmind and since_loss[i] < 3:
                want[: 3 - since_loss[i]] = 0  # frames from before the lost life
                checked += 1
            np.testing.assert_array_equal(obs[i], want)
            assert want[-1].any()  # the newest frame is never blank
        assert np.array_equal(term, lost | r_term) if deepmind else not (term & lost).any()
        if (deepmind and checked >= 6 and (since_loss >= 3).any()) or (not deepmind and lost.any()):
            break
    else:
        raise AssertionError("no life was lost")
    assert checked >= 6 or not deepmind
    envs.close()
    ref.close()


def test_clip_rewards_false_keeps_raw_training_rewards():
    raw_rewards, rewards, terminals, life_losses, info = play_against_reference("deepmind", clip_rewards=False)
    assert max(raw_rewards) > 1 and rewards == raw_rewards
    assert terminals == life_losses + 1  # still the training env: a terminal per lost life


def test_machado_no_life_loss_signal():
    raw_rewards, rewards, terminals, life_losses, info = play_against_reference("machado", seed=4)
    assert life_losses >= 2 and terminals == 1  # only the game over ends an episode
    assert info["episode"]["r"][0] == pytest.approx(sum(raw_rewards))
    np.testing.assert_allclose(rewards, np.clip(raw_rewards, -1, 1))


def test_eval_env_ends_at_game_over_with_true_return_and_video(tmp_path):
    env = make_env("ALE/Breakout-v5", seed=0, capture_video=True, video_dir=str(tmp_path))
    obs, _ = env.reset()
    assert obs.shape == (4, 84, 84)
    rng = np.random.default_rng(0)
    total, steps, lives_seen = 0.0, 0, set()
    while True:
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(0, 4)))
        total, steps = total + reward, steps + 1
        lives_seen.add(int(info["lives"]))
        if terminated or truncated:
            break
    assert len(lives_seen) >= 4  # several lives passed without ending the episode
    assert info["episode"]["r"] == pytest.approx(total) and info["episode"]["l"] == steps
    env.close()
    videos = list(tmp_path.glob("*.mp4"))
    assert videos and videos[0].stat().st_size > 1000


def test_cartpole_eval_env_records_a_video_with_the_video_extra(tmp_path, capfd):
    """CartPole draws its frames with pygame: the `video` extra (which the test extra includes) must bring it, and
    SDL must draw them off-screen without printing an `error:` line of its own (no display, no XDG_RUNTIME_DIR)."""
    env = make_env("CartPole-v1", seed=0, capture_video=True, video_dir=str(tmp_path / "videos"))
    env.reset()
    while not any(env.step(env.action_space.sample())[2:4]):
        pass
    env.close()
    videos = list((tmp_path / "videos").glob("*.mp4"))
    assert videos and all(v.stat().st_size > 1000 for v in videos), videos
    assert "error" not in capfd.readouterr().err


def test_async_batches_account_every_step_once():
    """ale-py async mode: per env, finished game lengths + the running length = actions sent to that env."""
    num_envs, batch = 6, 3
    envs = make_vector_env("ALE/Breakout-v5", num_envs, seed=2, num_threads=2, batch_size=batch)
    obs, info = envs.reset()
    assert obs.shape == (batch, 4, 84, 84)
    sent = np.zeros(num_envs, dtype=np.int64)
    finished = np.zeros(num_envs, dtype=np.int64)
    running = np.zeros(num_envs, dtype=np.int64)
    ids = info["env_id"]
    rng = np.random.default_rng(0)

    def receive():
        obs, reward, term, trunc, info = envs.recv()
        ended = info["_episode"]
        ids = info["env_id"]
        finished[ids[ended]] += info["episode"]["l"][ended]
        running[ids] = np.where(ended, 0, info["episode"]["l"])  # length so far of the game in progress
        return ids

    for _ in range(1500):
        envs.send(rng.integers(0, 4, batch))
        sent[ids] += 1
        ids = receive()
    receive()  # the other half still has actions in flight: collect them, sending nothing new
    assert finished.sum() > 0
    np.testing.assert_array_equal(finished + running, sent)
    envs.close()


def test_gymnasium_vector_env_episode_stats_and_same_step_reset():
    envs = make_vector_env("CartPole-v1", 4, seed=0)
    obs, _ = envs.reset()
    assert obs.shape == (4, 4) and obs.dtype == np.float32
    running = np.zeros(4)
    ended = 0
    for _ in range(300):
        obs, reward, term, trunc, info = envs.step(envs.action_space.sample())
        running += reward
        done = term | trunc
        for i in np.flatnonzero(done):
            assert info["episode"]["r"][i] == running[i] and info["episode"]["l"][i] == running[i]
            assert np.abs(obs[i]).max() <= 0.05  # SameStep autoreset: already the next episode's first obs
            running[i] = 0
            ended += 1
        assert len(finished_episodes(info)) == done.sum()
    assert ended > 10


def test_bad_ids_and_flags_give_one_line_errors():
    with pytest.raises(EnvError, match="did you mean ALE/Breakout-v5") as e:
        make_vector_env("ALE/Breakot-v5", 2, seed=0)
    assert "\n" not in str(e.value)
    with pytest.raises(EnvError, match="unknown env id"):
        check_env_args("NoSuchThing-v0")
    with pytest.raises(EnvError, match="protocol"):
        check_env_args("ALE/Pong-v5", protocol="atari57")
    with pytest.raises(EnvError, match=">= 1"):
        check_env_args("CartPole-v1", num_envs=0)
    with pytest.raises(EnvError, match="need an ALE id"):
        check_env_args("CartPole-v1", num_envs=4, batch_size=2)
    with pytest.raises(EnvError, match="batch_size"):
        check_env_args("ALE/Pong-v5", num_envs=4, batch_size=8)


def test_v4_ids_name_the_same_game():
    envs = make_vector_env("BreakoutNoFrameskip-v4", 1, seed=0, num_threads=1)
    assert envs.single_action_space.n == 4 and envs.reset()[0].shape == (1, 4, 84, 84)


def test_module_prefixed_ids_import_their_registration(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('MyCartPole-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    envs = make_vector_env("my_envs:MyCartPole-v0", 2, seed=0)
    assert envs.reset()[0].shape == (2, 4)
    with pytest.raises(EnvError, match="cannot import"):
        check_env_args("no_such_module:Foo-v0")


def test_capture_video_without_a_renderer_is_one_error_line_and_leaves_no_folder(tmp_path):
    """An env that cannot render (CartPole without pygame) fails when the env is made, as one line, and the video
    folder RecordVideo made is removed; `check_video` (the scripts' validate) gives the same line before a run."""
    video_dir = tmp_path / "videos-eval"
    with pytest.raises(EnvError, match=r"^--capture-video cannot render .*UnrenderableCartPole-v0: pygame") as e:
        make_env("tests.faulty_env:UnrenderableCartPole-v0", 0, capture_video=True, video_dir=str(video_dir))
    assert "\n" not in str(e.value) and not video_dir.exists()
    with pytest.raises(EnvError, match="cannot render"):
        check_video("tests.faulty_env:UnrenderableCartPole-v0")
    check_video("ALE/Pong-v5")  # ALE renders its own frames


@pytest.mark.parametrize(
    ("script", "extra"),
    [("a3c_large_batch", ()), ("apex_ddpg", ()), ("apex_dqn", ()), ("cleanba_ppo_impala", (1,)), ("gala_a2c", ()),
     ("hts_a2c", ()), ("hts_ppo", ()), ("impala_monobeast", ())],
)  # fmt: skip
def test_every_script_refuses_capture_video_it_cannot_record_before_the_run(script, extra):
    module = importlib.import_module(script)
    args = module.Args(env_id="tests.faulty_env:UnrenderableCartPole-v0", capture_video=True, eval_episodes=1)
    if hasattr(module, "settled_args"):  # as open_run, before validate: cleanba's --algo defaults, ...
        args = module.settled_args(args)
    error = module.validate(args, *extra)
    assert error is not None and error.startswith("--capture-video cannot render") and "\n" not in error, error
