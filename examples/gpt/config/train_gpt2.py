# GPT-2 small shape (12 layers, 12 heads, 768 dims; 124M parameters with GPT-2's vocabulary,
# 85M with bytes) with dilated attention, as nanoGPT's config/train_gpt2.py.
# On a GPU: `python train.py config/train_gpt2.py` (torchrun for several; the batch below is
# nanoGPT's ~0.5M tokens per step on 8 GPUs, 12 * 1024 * 40 = 491,520 tokens).
# The default corpus is the byte-level stdlib (vocab 256); a directory data/<name>/ with
# nanoGPT's uint16 GPT-2 train.bin/val.bin (e.g. openwebtext) works with --dataset=<name>.
out_dir = "out-gpt2"
dataset = "stdlib"
eval_interval = 1000
eval_iters = 200
log_interval = 10

batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

# LongNet-style branches: segment lengths and dilation rates grow geometrically; the largest
# segment spans the whole block.
attention_backend = "auto"
segment_lengths = [256, 512, 1024]
dilation_rates = [1, 2, 4]

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
warmup_iters = 2000
min_lr = 6e-5
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

dtype = "auto"
compile = True
