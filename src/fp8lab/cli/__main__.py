from fp8lab.cli import main

main()
