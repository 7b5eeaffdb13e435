"""One of two processes of tests/test_distributed.py: joins a `jax.distributed` job on loopback
(gloo CPU collectives, 4 fake devices per process), loads a model onto meshes over all 8 global
devices, generates, and prints one JSON line per case on stdout.

    python tests/distributed_worker.py MODEL_DIR PORT PROCESS_ID NUM_PROCESSES REQUEST_JSON

REQUEST_JSON: {"prompts": [[ids], ...], "max_new_tokens": n,
               "cases": [{"name", "mesh": {"data", "fsdp", "tensor"}, "rules"}, ...]}
Each output line: {"case", "process", "ids", "logits_last"} (logits_last: the last position's
logits of every prompt row, [B, V], gathered from every process). A request with "train_steps": n
trains instead (tests/test_train_sharded.py): each line is {"case", "process", "losses"}.
"""

import json
import os
import sys

LOCAL_DEVICES = 4
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"  # before jax is imported
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    model_dir, port, process_id, num_processes, request = sys.argv[1:]
    process_id, num_processes, request = int(process_id), int(num_processes), json.loads(request)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=60)
    assert jax.process_count() == num_processes, jax.process_count()
    assert jax.local_device_count() == LOCAL_DEVICES, jax.local_devices()
    assert jax.device_count() == LOCAL_DEVICES * num_processes, jax.devices()

    import linnet_jax
    from batches import right_padded, train_losses
    from linnet_jax.sharding import host, mesh

    prompts = request["prompts"]
    padded, mask = right_padded(prompts)
    last = np.array([len(p) - 1 for p in prompts])

    for case in request["cases"]:
        devices = mesh(**case["mesh"])
        model = linnet_jax.load(model_dir, mesh=devices, rules=case.get("rules"), progress=False)
        if "train_steps" in request:
            losses = train_losses(model, request["train_steps"])
            print(json.dumps({"case": case["name"], "process": process_id, "losses": losses}), flush=True)
            continue
        ids = linnet_jax.generate(model, tokens=prompts, max_new_tokens=request["max_new_tokens"], ignore_eos=True)
        logits = host(linnet_jax.logits(model, padded, attention_mask=mask))
        print(json.dumps({"case": case["name"], "process": process_id, "ids": ids,
                          "logits_last": logits[np.arange(len(prompts)), last].tolist()}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
