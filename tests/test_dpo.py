"""DPO: the loss, its gradient and the logged rewards against TRL's DPOTrainer (its own code, on the same tiny
transformers model and batch), LoRA's reference being the base with the adapters off, preference data, and runs
(Python and the command) that raise the reward margin."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import random_model, record_parity
from test_train import random_adapters, relative_errors

import linnet_jax
from linnet_jax import train
from linnet_jax.models.params import params_to_hf

BETA = 0.1
PAIRS = [
    {"prompt": "The sea is", "chosen": " blue and calm.", "rejected": " a cat that ran over seven hills."},
    {"prompt": "Birds sang of", "chosen": " rain.", "rejected": " bread"},
    {"messages": [{"role": "user", "content": "Name a colour."}], "chosen": "Blue.", "rejected": "Seven quiet hills."},
]


def write_jsonl(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def pair_batch(tiny_chat, tmp_path_factory) -> dict[str, np.ndarray]:
    """PAIRS as one preference batch: rows (chosen, rejected) interleaved, one reply each, padded to 40."""
    path = write_jsonl(tmp_path_factory.mktemp("dpo") / "pairs.jsonl", PAIRS)
    pairs, truncated = train.load_pairs(path, tiny_chat.tokenizer, seq_len=40)
    assert truncated == 0 and len(pairs) == len(PAIRS)
    return train.pack([doc for pair in pairs for doc in pair], 40, packing=False)


def trl_inputs(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The batch in TRL's layout: the chosen rows, then the rejected ones; attention and completion masks."""
    order = np.r_[0:len(batch["tokens"]):2, 1:len(batch["tokens"]):2]
    return {"input_ids": torch.tensor(batch["tokens"][order], dtype=torch.long),
            "attention_mask": torch.tensor(batch["segment_ids"][order] > 0, dtype=torch.long),
            "completion_mask": torch.tensor(batch["loss_mask"][order], dtype=torch.long)}


def trl_trainer(policy, reference, tokenizer, out_dir):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(out_dir), beta=BETA, loss_type=["sigmoid"], report_to=[], use_cpu=True,
                     bf16=False, logging_strategy="no", save_strategy="no")  # float32, as ours
    dataset = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dataset,
                         processing_class=tokenizer)
    trainer.model.train()  # as in a training step (no dropout in these models); TRL logs the rewards under "train"
    return trainer


def trl_loss_and_gradients(trainer, inputs) -> tuple[float, dict[str, np.ndarray], dict[str, float]]:
    """TRL's DPOTrainer.compute_loss on the inputs, its gradient (torch autograd) and the rewards it logs."""
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in trainer.model.named_parameters() if p.grad is not None}
    rewards = {name: values[-1] for name, values in trainer._metrics["train"].items() if name.startswith("rewards/")}
    return loss.item(), grads, rewards


def compare(case: str, ours: tuple, theirs: tuple) -> None:
    (loss, rewards, grads), (trl_loss, trl_grads, trl_rewards) = ours, theirs
    loss_diff = abs(float(loss) - trl_loss)
    errors = relative_errors(grads, trl_grads)
    worst = max(errors, key=errors.get)
    grad_diff = max(float(np.abs(grads[name] - trl_grads[name]).max()) for name in grads)
    record_parity(f"DPO {case}: |loss - TRL|", loss_diff)
    record_parity(f"DPO {case}: max |gradient - TRL|", grad_diff)
    record_parity(f"DPO {case}: worst gradient ‖g - g_TRL‖/‖g_TRL‖", errors[worst])
    assert loss_diff < 1e-5 and grad_diff < 1e-5 and errors[worst] < 1e-4, (loss, trl_loss, worst, errors[worst])
    assert set(rewards) == set(trl_rewards) == {"rewards/chosen", "rewards/rejected", "rewards/margins",
                                                 "rewards/accuracies"}
    for name, value in rewards.items():
        assert abs(float(value) - trl_rewards[name]) < 1e-5, (name, float(value), trl_rewards[name])


def test_dpo_loss_and_gradient_equal_trls(tiny_chat, tiny_chat_dir, pair_batch, tmp_path):
    """Full fine-tuning against a reference of other weights, and reference-free (TRL's loss given reference
    log-probs of 0)."""
    hf_config = transformers.AutoConfig.from_pretrained(tiny_chat_dir)
    reference_torch = random_model(hf_config, seed=1)
    reference_torch.save_pretrained(tmp_path / "reference")
    reference = linnet_jax.load(tmp_path / "reference", progress=False)
    batch = jax.tree.map(jnp.asarray, pair_batch)

    def ours(**options):
        (loss, rewards), grads = jax.value_and_grad(train.dpo_loss, has_aux=True)(
            tiny_chat.params, tiny_chat.config, batch, beta=BETA, **options)
        return loss, rewards, params_to_hf(grads, tiny_chat.config)

    policy = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_dir, dtype=torch.float32,
                                                               attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_chat_dir)
    trainer = trl_trainer(policy, reference_torch, tokenizer, tmp_path / "trl")
    inputs = trl_inputs(pair_batch)
    with_reference = ours(reference=reference.params)
    assert float(with_reference[1]["rewards/margins"]) != 0  # the reference differs from the policy
    compare("full, reference of other weights", with_reference, trl_loss_and_gradients(trainer, inputs))

    trainer.precompute_ref_logps = True  # TRL then takes the reference's log-probs from the inputs
    zeros = torch.zeros(len(PAIRS))
    compare("reference-free", ours(reference_free=True),
            trl_loss_and_gradients(trainer, inputs | {"ref_chosen_logps": zeros, "ref_rejected_logps": zeros}))


def test_lora_reference_is_the_base_with_the_adapters_off(tiny_chat, pair_batch):
    """LoRA's DPO (no reference given: the same weights, adapters off) equals DPO on the merged weights against
    the base, and needs a reference otherwise."""
    lora = random_adapters(tiny_chat.config, 4, ("q_proj", "v_proj", "down_proj"))
    batch = jax.tree.map(jnp.asarray, pair_batch)
    loss, rewards = train.dpo_loss(tiny_chat.params, tiny_chat.config, batch, beta=BETA, lora=lora)
    merged = train.merge_lora(tiny_chat, lora)
    expected, expected_rewards = train.dpo_loss(merged.params, tiny_chat.config, batch, beta=BETA,
                                                reference=tiny_chat.params)
    assert abs(float(loss) - float(expected)) < 1e-5 and float(rewards["rewards/margins"]) != 0
    for name in rewards:
        assert abs(float(rewards[name]) - float(expected_rewards[name])) < 1e-5, name
    with pytest.raises(ValueError, match="DPO needs a reference"):
        train.dpo_loss(tiny_chat.params, tiny_chat.config, batch)


def test_preference_data(tiny_chat, tmp_path):
    """Only the reply counts; a conversation's reply is its last assistant turn, as `chat_document` renders it;
    bad records are named."""
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS[1:])
    (chosen, rejected), (chat_chosen, _) = train.load_pairs(path, tiny_chat.tokenizer, seq_len=64)[0]
    tokenizer = tiny_chat.tokenizer
    prompt = tokenizer.encode("Birds sang of", add_special_tokens=True)
    for doc, reply in ((chosen, " rain."), (rejected, " bread")):
        reply_ids = tokenizer.encode(reply) + [tokenizer.eos_token_ids[0]]
        assert doc.tokens.tolist() == prompt + reply_ids
        assert doc.loss_mask.tolist() == [0] * len(prompt) + [1] * len(reply_ids)
    messages = PAIRS[2]["messages"] + [{"role": "assistant", "content": "Blue."}]
    sft = train.data.chat_document(messages, tokenizer, "x")
    assert chat_chosen.tokens.tolist() == sft.tokens.tolist()
    assert chat_chosen.loss_mask.tolist() == sft.loss_mask.tolist()
    assert tokenizer.decode(chat_chosen.tokens[chat_chosen.loss_mask > 0]).startswith("Blue.")
    for record, message in (({"prompt": "a", "chosen": "b"}, "expected a preference record"),
                            ({"prompt": "a", "messages": [], "chosen": "b", "rejected": "c"}, "not both"),
                            ({"messages": [], "chosen": "b", "rejected": "c"}, "messages are empty"),
                            ({"prompt": "a", "chosen": "b", "rejected": " "}, "completion is empty"),
                            ({"prompt": "a", "chosen": "b", "rejected": "b"}, '"chosen" and "rejected" are the same'),
                            ({"messages": PAIRS[2]["messages"] + [{"role": "assistant", "content": "Blue."}],
                              "chosen": "b", "rejected": "c"}, "the messages end with an assistant turn")):
        write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], record])
        with pytest.raises(train.DataError, match=f"bad.jsonl:2: .*{message}"):
            train.load_pairs(tmp_path / "bad.jsonl", tokenizer, seq_len=64)
    with pytest.raises(ValueError, match="preference pairs"):
        train.Batches(train.load_pairs(path, tokenizer, seq_len=64)[0], 2, 64)  # packing is for SFT


def test_dpo_raises_the_reward_margin(tiny_chat, tmp_path):
    """LoRA through the Python API: step 1's rewards are 0 (B = 0, the policy is its reference); a few steps
    later the chosen replies are the likelier. Pairs stay together across batches and epochs."""
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    result = train.finetune(tiny_chat, path, tmp_path / "run", method="dpo", beta=BETA, steps=8, batch_size=2,
                            seq_len=40, lr=1e-2, lora=train.LoraConfig(rank=8, alpha=16), progress=False)
    first, last = result.metrics[0], result.metrics[-1]
    assert abs(first["rewards/margins"]) < 1e-6 and abs(first["rewards/chosen"]) < 1e-6
    assert abs(first["loss"] - np.log(2)) < 1e-6
    assert last["rewards/margins"] > 0.5 and last["rewards/accuracies"] == 1 and last["loss"] < 0.5, last
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["rewards/margins"] for line in lines] == [m["rewards/margins"] for m in result.metrics]


def test_dpo_command_full_fine_tuning_with_evaluation(tiny_chat_dir, tmp_path, capsys):
    """`linnet-jax finetune --method dpo --lora-rank 0` (a frozen copy of the initial params is the reference)
    with lm-eval run every 2 steps: each result lands in that step's line of metrics.jsonl."""
    from test_lmeval import write_tasks

    from linnet_jax.cli import main

    write_tasks(tmp_path)
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    main(["finetune", "--model", str(tiny_chat_dir), "--data", str(path), "--method", "dpo", "--beta", "0.1",
          "--lora-rank", "0", "--steps", "4", "--batch-size", "3", "--seq-len", "40", "--lr", "1e-3",
          "--eval-tasks", "linnet_choice", "--eval-include-path", str(tmp_path), "--eval-every", "2",
          "--no-compilation-cache", str(tmp_path / "run")])
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [("eval/linnet_choice/acc,none" in line) for line in lines] == [False, True, False, True]
    assert all(0 <= line["eval/linnet_choice/acc,none"] <= 1 for line in lines[1::2])
    assert lines[-1]["rewards/margins"] > lines[0]["rewards/margins"] and lines[-1]["rewards/accuracies"] == 1
    assert "reward margin" in capsys.readouterr().out and (tmp_path / "run" / "model" / "config.json").is_file()


@pytest.mark.parametrize("flags, expected", [
    (["--beta", "0.2"], "--beta and --reference-free are DPO's"),
    (["--reference-free"], "--beta and --reference-free are DPO's"),
    (["--method", "dpo", "--beta", "0"], "must be a finite number > 0"),
    (["--eval-every", "2"], "--eval-every needs --eval-tasks"),
])
def test_dpo_and_eval_flags_are_refused_at_parse_time(tmp_path, capsys, flags, expected):
    from linnet_jax.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--data", "x.jsonl", *flags, str(tmp_path / "run")])
    assert exit_info.value.code == 2 and expected in capsys.readouterr().err
