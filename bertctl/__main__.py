from bertctl.cli.app import main

main()
