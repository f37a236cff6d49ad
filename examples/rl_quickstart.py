"""The RL-primitives quick start on our API: inference, environment, rollout manager, backprop, PPO, train.

.venv/bin/python examples/rl_quickstart.py    (a bridge child on the embedded SmolLM2; a few minutes on CPU)
"""

from grpo import (
    AlgorithmConfig,
    BackpropConfig,
    BackpropModule,
    InferenceModule,
    PPOAlgorithm,
    RolloutConfig,
    RolloutManager,
)
from grpo.bridge_proc import bridge_process
from grpo.tasks import ArithmeticEnvironment


def main() -> None:
    from engines.model_store import ensure_converted, load_model_and_tokenizer

    with bridge_process("embedded") as target:
        inference = InferenceModule(target)  # generate / get_logprobs / get_logits through the bridge
        environment = ArithmeticEnvironment()  # an envhub.Environment: a calculator tool, then the answer
        rollout_manager = RolloutManager(inference, environment, RolloutConfig(group_size=4, turn_max_tokens=[32, 8]))
        model, _ = load_model_and_tokenizer(ensure_converted())
        backprop = BackpropModule(
            model.train(), BackpropConfig(lr=2e-5, kl_coef=0.01, ref_update="ema"), value_head=True
        )
        algorithm = PPOAlgorithm(inference, rollout_manager, backprop, AlgorithmConfig(out_dir="bench/out/quickstart"))
        for row in algorithm.train(num_iterations=3, progress_bar=True):
            print(f"step {row['step']}: reward {row['reward']:.3f}, loss {row['loss']:.4f}")
        inference.close()


if __name__ == "__main__":
    main()
