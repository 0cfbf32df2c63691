"""The engine process: the step loop (schedule, one packed forward, verify, update, draft), the typed wire to the
server, and the configuration it is built from. engine/model/ runs the models; engine/calibration/ holds the
offline tools that drive an Engine, which the engine itself never imports."""
