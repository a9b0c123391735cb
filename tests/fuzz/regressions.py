"""The fixed regression corpus: minimal specs of failures the long fuzz found, run first by ``test_fuzz_ci``
(hypothesis' explicit examples).  Add each new signature's minimised spec here, with the issue and what it
showed on the code before the fix.
"""

from __future__ import annotations

from tests.fuzz.spec import from_json

# issue 42 (main 9410fdc), stage 1:
#   sync-nosync-sync: the no_sync micro-batch's gradient dropped by the next synced backward (0.3% off in
#     float64); sync-sync-unused: an average reduced again by a rank that skipped the block in the second
#     synced backward; bf16 with tied blocks: the same, 0.55 update error against 0.11 allowed;
#   offload + SGD with momentum: torch's fused SGD raised TypeError when a parameter's first gradient came
#     after the first step ([Note: reduced regions and later backwards] in zero_plugin/grads/reducer.py;
#     ``_sgd_with_momentum`` in zero_plugin/optim/offload.py).
# issue 42, found by the extended draw (forwards without backward, weight writes): stages 0-2 with bf16
#   parameters trained on from the old weights after model.load_state_dict ([Note: writes to parameters
#   behind separate masters] in zero_plugin/engines/replicated.py).
# issue 42, fresh seed 90210: stage 3 hung when one rank discarded the last of four blocks ([Note: units the
#   backward passed] in zero_plugin/stage3/hooks.py); seed 271828: the same when one of three ranks used no
#   block's output (its reductions waited behind its end-of-backward gathers).
# issue 42, fresh seeds 77777 and 300301 (minimised): stage 3 hung when a rank's backward passed three blocks
#   before reaching one: it marked them ready at once and blocked on the first reduction before gathering the
#   second, which its peer gathered before reducing the first (the walk in ``hooks.BackwardWalk.catch_up``).
# issue 42, fresh seeds 77777, 300301, 912345: bf16 update errors at stages 0, 1 and 3 with bf16 reduction and
#   AdamW, all from elements whose gradient sum lies within the bf16 sum's rounding of zero (AdamW steps them
#   by about +-lr whatever their size); the check leaves those out ([Note: gradients within the reduction's
#   rounding of zero] in tests/fuzz/reference.py); before, this spec failed the check with 0.135 > 0.02.
# issue 42, fresh seed 2718281: the same with fp32 reduction, from micro-batches under no_sync adding up in the
#   bf16 param.grad at stages 0-1 (as under DDP): 0.0677 > 0.02 before the check counted them.
# issue 42, fresh seed 1618033: the same with synced micro-batches (summed in the bf16 param.grad after each
#   reduction at stage 0), and a second step on weights that differ at the masked elements: 0.0875, then 0.0276,
#   against 0.02 (the check now allows twice as much after such a step).
REGRESSIONS: dict[str, dict] = {
    "stage1-sync-nosync-sync": from_json(
        '{"bucket_size_mb":25.0,"buffered":false,"model":{"batch":1,"bias":true,"d_in":3,"d_out":2,"frozen":['
        '],"tie_to":[null,null],"widths":[3,3]},"offload":false,"optimizer":{"kind":"sgd","lr":0.2,"momentum"'
        ':0.0,"two_groups":false,"weight_decay":0.0},"precision":"fp64","schedule":[["micro",{"scale":0.33333'
        '33333333333,"sync":true,"usage":[[2,2],[2,2]]}],["micro",{"scale":0.3333333333333333,"sync":false,"u'
        'sage":[[2,2],[2,2]]}],["micro",{"scale":0.3333333333333333,"sync":true,"usage":[[2,2],[2,2]]}],["ste'
        'p"],["zero_grad","optimizer"]],"seed":1,"stage":1,"stage3":{"persistence_threshold":0,"prefetch_dept'
        'h":1,"reshard_after_forward":true},"world_size":2}'
    ),
    "stage1-sync-sync-unused-on-a-rank": from_json(
        '{"bucket_size_mb":25.0,"buffered":false,"model":{"batch":1,"bias":true,"d_in":3,"d_out":2,"frozen":['
        '],"tie_to":[null,null],"widths":[3,3]},"offload":false,"optimizer":{"kind":"sgd","lr":0.2,"momentum"'
        ':0.0,"two_groups":false,"weight_decay":0.0},"precision":"fp64","schedule":[["micro",{"scale":0.5,"sy'
        'nc":true,"usage":[[2,2],[2,2]]}],["micro",{"scale":0.5,"sync":true,"usage":[[2,2],[0,2]]}],["step"],'
        '["zero_grad","optimizer"]],"seed":1,"stage":1,"stage3":{"persistence_threshold":0,"prefetch_depth":1'
        ',"reshard_after_forward":true},"world_size":2}'
    ),
    "stage1-bf16-tied-two-synced": from_json(
        '{"bucket_size_mb":0.0001,"buffered":true,"model":{"batch":2,"bias":false,"d_in":5,"d_out":4,"frozen"'
        ':[],"tie_to":[null,0,null],"widths":[6,6,7]},"offload":false,"optimizer":{"kind":"sgd","lr":0.2,"mom'
        'entum":0.9,"two_groups":false,"weight_decay":0.01},"precision":"bf16","schedule":[["micro",{"scale":'
        '0.5,"sync":true,"usage":[[2,1,0],[1,1,1],[2,2,2],[0,2,1]]}],["micro",{"scale":0.5,"sync":true,"usage'
        '":[[1,1,2],[2,1,2],[0,1,2],[0,2,2]]}],["clip",0.05],["step"],["zero_grad","optimizer"]],"seed":253,"'
        'stage":1,"stage3":{"persistence_threshold":0,"prefetch_depth":2,"reshard_after_forward":false},"worl'
        'd_size":4}'
    ),
    "stage1-offload-sgd-momentum-late-first-gradient": from_json(
        '{"bucket_size_mb":25.0,"buffered":true,"model":{"batch":2,"bias":false,"d_in":3,"d_out":1,"frozen":['
        '],"tie_to":[null,null],"widths":[6,8]},"offload":true,"optimizer":{"kind":"sgd","lr":0.2,"momentum":'
        '0.9,"two_groups":true,"weight_decay":0.0},"precision":"bf16","schedule":[["micro",{"scale":0.3333333'
        '333333333,"sync":true,"usage":[[0,2],[0,2]]}],["micro",{"scale":0.3333333333333333,"sync":false,"usa'
        'ge":[[1,2],[2,0]]}],["micro",{"scale":0.3333333333333333,"sync":true,"usage":[[0,2],[0,1]]}],["clip"'
        ',0.05],["zero_grad","optimizer"],["micro",{"scale":0.5,"sync":false,"usage":[[0,0],[1,2]]}],["micro"'
        ',{"scale":0.5,"sync":true,"usage":[[1,2],[0,1]]}],["step"],["zero_grad","optimizer"],["micro",{"scal'
        'e":1.0,"sync":true,"usage":[[2,2],[0,0]]}],["clip",100.0],["step"],["zero_grad","model"]],"seed":271'
        ',"stage":1,"stage3":{"persistence_threshold":8,"prefetch_depth":0,"reshard_after_forward":true},"wor'
        'ld_size":2}'
    ),
    "stages0-2-bf16-load-state-dict-between-steps": from_json(
        '{"bucket_size_mb":25.0,"buffered":false,"model":{"batch":2,"bias":true,"d_in":3,"d_out":2,"frozen":['
        '],"tie_to":[null,null],"widths":[5,5]},"offload":false,"optimizer":{"kind":"adamw","lr":0.05,"moment'
        'um":0.0,"two_groups":false,"weight_decay":0.0},"precision":"bf16","schedule":[["micro",{"scale":1.0,'
        '"sync":true,"usage":[[2,2],[2,2]]}],["step"],["zero_grad","optimizer"],["forward",{"usage":[[2,2],[2'
        ',2]]}],["write",{"how":"load","seed":3}],["forward",{"usage":[[2,2],[2,2]]}],["micro",{"scale":1.0,"'
        'sync":true,"usage":[[2,2],[2,2]]}],["forward",{"usage":[[2,2],[2,2]]}],["step"],["zero_grad","optimi'
        'zer"],["forward",{"usage":[[2,2],[2,2]]}],["micro",{"scale":1.0,"sync":true,"usage":[[2,2],[2,2]]}],'
        '["step"],["zero_grad","model"]],"seed":1,"stage":1,"stage3":{"persistence_threshold":0,"prefetch_dep'
        'th":1,"reshard_after_forward":true,"secondary_shard_size":null},"world_size":2}'
    ),
    "stage3-last-block-discarded-on-one-rank-hang": from_json(
        '{"bucket_size_mb":25.0,"buffered":true,"model":{"batch":1,"bias":false,"d_in":1,"d_out":1,"frozen":['
        '],"tie_to":[null,null,null,null],"widths":[1,1,1,1]},"offload":false,"optimizer":{"kind":"sgd","lr":'
        '0.05,"momentum":0.9,"two_groups":true,"weight_decay":0.0},"precision":"fp64","schedule":[["micro",{"'
        'scale":1.0,"sync":true,"usage":[[2,2,2,1],[2,2,2,2]]}]],"seed":44,"stage":3,"stage3":{"persistence_t'
        'hreshold":0,"prefetch_depth":0,"reshard_after_forward":true,"secondary_shard_size":null},"world_size'
        '":2}'
    ),
    "stage3-one-rank-uses-no-block-hang": from_json(
        '{"bucket_size_mb":25.0,"buffered":false,"model":{"batch":3,"bias":true,"d_in":5,"d_out":2,"frozen":['
        '],"tie_to":[null,null,0,null],"widths":[6,5,6,8]},"offload":false,"optimizer":{"kind":"adamw","lr":0'
        '.05,"momentum":0.0,"two_groups":false,"weight_decay":0.1},"precision":"fp64","schedule":[["micro",{"'
        'scale":1.0,"sync":true,"usage":[[1,2,2,2],[2,2,2,1],[1,1,1,1]]}],["step"],["zero_grad","optimizer"]]'
        ',"seed":397,"stage":3,"stage3":{"persistence_threshold":0,"prefetch_depth":0,"reshard_after_forward"'
        ':true,"secondary_shard_size":null},"world_size":3}'
    ),
    "stage3-three-blocks-passed-before-backward-hang": from_json(
        '{"bucket_size_mb":25.0,"buffered":true,"model":{"batch":2,"bias":false,"d_in":3,"d_out":4,"frozen":['
        '],"tie_to":[null,null,null,null],"widths":[6,3,3,6]},"offload":false,"optimizer":{"kind":"adamw","lr'
        '":0.01,"momentum":0.0,"two_groups":true,"weight_decay":0.0},"precision":"fp64","schedule":[["micro",'
        '{"scale":1.0,"sync":true,"usage":[[2,2,2,2],[2,1,1,1]]}],["step"],["zero_grad","optimizer"]],"seed":'
        '3660,"stage":3,"stage3":{"persistence_threshold":0,"prefetch_depth":0,"reshard_after_forward":true,"'
        'secondary_shard_size":null},"world_size":2}'
    ),
    "stage3-hpz-bf16-sum-adamw-near-zero-gradients": from_json(
        '{"bucket_size_mb":0.0001,"buffered":false,"model":{"batch":2,"bias":true,"d_in":1,"d_out":4,"frozen"'
        ':["blocks.1.fc.bias","head.bias"],"tie_to":[null,null],"widths":[6,9]},"offload":false,"optimizer":{'
        '"kind":"adamw","lr":0.05,"momentum":0.0,"two_groups":false,"weight_decay":0.1},"precision":"bf16","s'
        'chedule":[["micro",{"scale":0.3333333333333333,"sync":false,"usage":[[2,2],[2,2],[2,2]]}],["micro",{'
        '"scale":0.3333333333333333,"sync":true,"usage":[[2,2],[2,2],[2,2]]}],["micro",{"scale":0.33333333333'
        '33333,"sync":true,"usage":[[2,2],[2,2],[2,2]]}],["clip",1.0],["step"],["zero_grad","model"]],"seed":'
        '9244,"stage":3,"stage3":{"persistence_threshold":0,"prefetch_depth":2,"reshard_after_forward":true,"'
        'secondary_shard_size":3},"world_size":3}'
    ),
    "stage0-bf16-reduce-fp32-no-sync-tied-adamw-near-zero-gradients": from_json(
        '{"seed":65535,"world_size":4,"stage":0,"buffered":true,"offload":false,"precision":"bf16_reduce_fp32'
        '","bucket_size_mb":0.0001,"stage3":{"prefetch_depth":2,"reshard_after_forward":true,"persistence_thr'
        'eshold":8,"secondary_shard_size":null},"optimizer":{"two_groups":false,"kind":"adamw","momentum":0.0'
        ',"weight_decay":0.1,"lr":0.01},"model":{"d_in":3,"widths":[7,7],"d_out":5,"bias":true,"batch":3,"tie'
        '_to":[null,0],"frozen":["blocks.0.fc.bias"]},"schedule":[["micro",{"sync":false,"scale":0.5,"usage":'
        '[[2,2],[2,2],[2,2],[2,2]]}],["micro",{"sync":true,"scale":0.5,"usage":[[2,2],[2,2],[2,2],[2,2]]}],["'
        'step"],["zero_grad","optimizer"]]}'
    ),
    "stage0-bf16-reduce-fp32-synced-micro-batches-then-a-second-step": from_json(
        '{"seed":485,"world_size":3,"stage":0,"buffered":true,"offload":false,"precision":"bf16_reduce_fp32",'
        '"bucket_size_mb":0.0001,"stage3":{"prefetch_depth":2,"reshard_after_forward":true,"persistence_thres'
        'hold":8,"secondary_shard_size":null},"optimizer":{"kind":"adamw","momentum":0.0,"lr":0.05,"weight_de'
        'cay":0.1,"two_groups":true},"model":{"d_in":2,"widths":[5,5],"d_out":5,"bias":false,"batch":1,"tie_t'
        'o":[null,0],"frozen":[]},"schedule":[["micro",{"sync":true,"scale":0.5,"usage":[[0,1],[2,2],[2,2]]}]'
        ',["micro",{"sync":true,"scale":0.5,"usage":[[1,1],[2,1],[2,2]]}],["forward",{"usage":[[1,1],[2,1],[2'
        ',2]]}],["step"],["zero_grad","optimizer"],["forward",{"usage":[[1,0],[1,0],[0,0]]}],["micro",{"sync"'
        ':true,"scale":1.0,"usage":[[2,1],[1,2],[2,0]]}],["clip",1.0],["step"],["zero_grad","optimizer"]]}'
    ),
}
