"""A toy task and a tiny model the project builds itself (no hub download).

Used by the tests and `make demo`. The task: the prompt is a few letters
followed by '=', the answer is the prompt's last letter. The tiny model is
pre-trained briefly on the answer format with mostly random answers, so it
starts well below solving the task and CISPO has something to learn.
"""
