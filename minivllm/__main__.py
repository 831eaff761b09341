from minivllm.cli import main

main()
